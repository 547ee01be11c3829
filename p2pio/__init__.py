"""Byte streams over libp2p that more than one side of a run speaks.

A trip is one bounded message over one libp2p stream, framed as hivemind frames it (`framing.py`); the
trip relay (`relay_service.py`) carries such streams for peers behind NAT. The peer daemon uses both, and
the tracker's node relays too, since it is the one node every run has on a public address; `peer` and
`tracker` may not import one another, so this package imports only `swarm` and hivemind, like `dhtio`.
`sockets.py` keeps the unix sockets of every process's hivemind daemons in a directory it removes at exit.
"""
