"""The dashboard across gates: a static site from the history database, change points marked.

::

    changepoints.py  find_change_points: steps and creeps in one series (ruptures' PELT, linear cost)
    series.py        a gate key's history as series: gated metric per run, baseline, pins, changes
    site.py          the pages: index.html (every key, latest verdict, sparklines), one page per key

``servegate dashboard --out DIR`` (:mod:`servegate.commands.dashboard`) writes it;
``servegate status`` names each key's latest change point with :func:`latest_change_point`.
See docs/dashboard.md.
"""

from __future__ import annotations

from servegate.dashboard.changepoints import ChangePoint, find_change_points

__all__ = ["ChangePoint", "find_change_points"]
