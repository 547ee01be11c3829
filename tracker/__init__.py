"""The tracker: the run's front door (manifest and bootstrap) and its status page (DESIGN.md §1, §4).

It is read-only and never in the data path: the swarm keeps training while it is down.
It imports `swarm`, never `peer`.
"""
