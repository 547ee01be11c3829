"""A run's records on the DHT: the reads and writes every networked side shares.

`swarm` defines the records (schemas and the rules they follow) and never touches the network nor
imports hivemind; `peer`, `tracker` and `launcher` may not import one another. What needs hivemind's
DHT to hold records (the validators, the signing keys, the calls that read and write records through
a live DHT and the parsing of what they return) is needed by all three, so it lives here, in a package
that imports only `swarm` and hivemind and that all three may import.
"""
