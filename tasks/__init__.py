"""Prefect tasks, one module per gate stage (shipped as ``servegate.tasks``).

Each task is a thin typed wrapper: it runs the stage declared in ``servegate.stages`` through
``servegate.tasks._stage.perform`` (skip rules, timing, tables written to the run folder, a
markdown artifact) and returns the stage's ``StageResult`` — as a ``Failed`` state carrying the
result when the stage failed, so Prefect's UI shows it red while the flow still gets the data.
"""
