"""Shared fixtures."""
import os

import pytest


@pytest.fixture
def single_process(monkeypatch):
    """A 1×1 cluster whatever launched pytest: no launcher variables, no initialised prunex_hvd before or after."""
    import prunex_hvd as px
    for var in list(os.environ):
        if var.startswith(("OMPI_", "PMIX_", "PMI_", "HOROVOD_", "PRUNEX_")) or var in ("RANK", "WORLD_SIZE"):
            monkeypatch.delenv(var)
    px.shutdown()
    yield
    px.shutdown()


@pytest.fixture(scope="session")
def full_run(shared_launch):
    """The uninterrupted reference run of tests/training_job.py (resume tests compare with it): (its run folder,
    what its ranks printed)."""
    from training_job import FULL, case_run
    return case_run(shared_launch, FULL)


@pytest.fixture(scope="session")
def digits():
    """The digits dataset at its default 16×16 (loaded once; tests read it, none modifies it)."""
    from prunex_hvd.app.data import load_dataset
    return load_dataset("digits")


@pytest.fixture(scope="session")
def shared_launch(tmp_path_factory):
    """``shared_launch(GROUP)``: the one job of every case registered for GROUP (tests/shared_launches.py),
    launched on first use: (the finished job, its out folder)."""
    import shared_launches
    done = {}

    def launched(group):
        if group not in done:
            done[group] = shared_launches.launch(group, tmp_path_factory.mktemp(group))
        return done[group]
    return launched
