"""Prefect tasks, one module per gate stage (shipped as ``servegate.tasks``).

Each task is a thin typed wrapper: it calls the stage's plain function in
``servegate.bench`` (or ``servegate.launch``/``servegate.validate``), hands the tables
to the :class:`servegate.gate.GateRun`, and publishes a markdown artifact.
"""
