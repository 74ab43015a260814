"""Harnesses shared by the test tiers (tests/unit, tests/integration): test modules import from here, never from
each other. `tests/` is on sys.path through tests/conftest.py (pytest's rootdir-relative imports), so this
package imports as `helpers`."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
ROOT = TESTS.parent  # the repository
FIXTURES = TESTS / "fixtures"
