"""``python -m prunex_hvd.engine.sparsity.native``: build the kernel now (``make setup`` does) and say what runs."""
from . import build, describe

path = build()
print(f"prunex_hvd native shrink/recover: {describe()}" + (f" ({path})" if path else ""))
