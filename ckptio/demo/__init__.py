"""The ckptio demo: train a small GPT, kill it mid-save, resume it, and compare every loss.

    ckptio demo              # about a minute on 2 cores; --quick (or CKPTIO_DEMO_QUICK=1): seconds

Modules: ``model`` (the GPT, its text and the resumable data loader), ``train`` (one training
process: build, maybe restore, train, checkpoint through ckptio.CheckpointManager, write its
losses as JSON), ``launch`` (starting training processes, one or several ranks, and reading what
they wrote), ``main`` (the orchestration, the table, the plot).

Needs only torch and tqdm (matplotlib, if installed, draws the plot); no numpy, no download: the
text is Python's own documentation (``pydoc_data.topics``).

A driver (the top layer, beside api and cli), and internal: it uses only ckptio's public surface
(``ckptio`` itself, ckptio/__init__.py's ``__all__``), which is all that ``ckptio`` promises.
"""

__all__: list[str] = []
