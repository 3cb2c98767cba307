"""How every benchmark hands over its result: the JSON document printed, and written to ``out`` when given."""
import json
import os
from typing import Optional


def emit(doc: dict, out: Optional[str] = None) -> None:
    text = json.dumps(doc, indent=1)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            f.write(text + "\n")
    print(text)
