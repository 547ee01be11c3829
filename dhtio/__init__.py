"""A run's records on the DHT: the reads and writes every networked side shares.

`swarm` defines the records (schemas, validators, parsing) and never touches the network;
`peer`, `tracker` and `launcher` may not import one another. The few calls that read and write
records through a live hivemind DHT are needed by all three, so they live here, in a package
that imports only `swarm` and hivemind and that all three may import.
"""
