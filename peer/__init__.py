"""protocol-peer: the volunteer daemon."""
