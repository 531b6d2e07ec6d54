"""Prefect flows (shipped as ``servegate.flows``); they compose tasks and hold no logic."""
