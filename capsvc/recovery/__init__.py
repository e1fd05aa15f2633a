"""Putting the journal back into Redis: when (reconciler.py), what (planner.py) and how, in
bulk (restore.py).
"""
