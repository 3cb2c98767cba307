"""The training application on top of the library: ``prunex-hvd`` (:mod:`.cli`), the training loop
(:mod:`.train`), the ``--method`` switch (:mod:`.methods`), models, data, checkpoints, reports and export.
"""
