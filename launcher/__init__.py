"""`protocol-swarm`: inspect and simulate a run, or start a whole swarm on this machine.

It sits above the others: it imports `swarm` and `dhtio`, and starts `protocol-peer` and
`protocol-tracker` as processes, never importing `peer` or `tracker`. Nothing imports it but
the tests and the benchmarks.
"""
