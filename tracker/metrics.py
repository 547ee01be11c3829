"""Prometheus exposition of the swarm snapshot.

Metrics are produced from the last summary at scrape time (a custom collector on a private
registry), so a scrape never touches the DHT. Labels are only stage numbers and states, never
peer-published strings: cardinality stays bounded and nothing untrusted reaches the output.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from swarm.records import PEER_STATES


class SwarmCollector(Collector):
    def __init__(self, snapshot: Callable[[], dict[str, Any]], monitor_stats: Callable[[], dict[str, float]]) -> None:
        self._snapshot = snapshot
        self._stats = monitor_stats

    def collect(self) -> Iterator[Metric]:
        s = self._snapshot()
        totals = s["totals"]
        yield GaugeMetricFamily(
            "protocol_swarm_healthy", "1 when every stage has an online peer", value=int(s["healthy"])
        )
        yield GaugeMetricFamily(
            "protocol_swarm_u_version", "highest U version among online peers", value=s["u_version"]
        )
        yield GaugeMetricFamily(
            "protocol_swarm_capacity_tokens_per_second",
            "throughput of the weakest stage (pipeline bottleneck)",
            value=totals["capacity_tokens_per_s"],
        )
        # run-level counters (tracker.counters): they never go back when a peer leaves, so they are counters
        yield CounterMetricFamily(
            "protocol_swarm_tokens_trained",
            "tokens trained in this run, counted by the stage-0 drivers, including drivers that left",
            value=totals["tokens_trained"],
        )
        yield CounterMetricFamily(
            "protocol_swarm_bytes_sent",
            "boundary bytes sent in this run, including by peers that left",
            value=totals["bytes_sent"],
        )
        yield CounterMetricFamily(
            "protocol_swarm_dense_equivalent_bytes",
            "what the run's traffic would have cost uncompressed",
            value=totals["dense_equivalent_bytes"],
        )
        yield GaugeMetricFamily(
            "protocol_swarm_online_tokens_trained",
            "tokens counted by the stage-0 drivers online now (falls when one leaves)",
            value=s["online"]["tokens_trained"],
        )
        if totals["loss"] is not None:
            yield GaugeMetricFamily(
                "protocol_swarm_loss", "token-weighted loss reported by stage-0 drivers", value=totals["loss"]
            )
        peers = GaugeMetricFamily("protocol_swarm_stage_peers", "peers per stage and state", labels=["stage", "state"])
        throughput = GaugeMetricFamily(
            "protocol_swarm_stage_throughput_tokens_per_second",
            "summed throughput of a stage's serving peers",
            labels=["stage"],
        )
        load = GaugeMetricFamily("protocol_swarm_stage_load", "trips in flight on a stage", labels=["stage"])
        for row in s["stages"]:
            stage = str(row["stage"])
            counts = dict.fromkeys(PEER_STATES, 0)
            for peer in row["peers"]:
                counts[peer["state"]] = counts.get(peer["state"], 0) + 1
            for state, n in counts.items():
                peers.add_metric([stage, state], n)
            throughput.add_metric([stage], row["throughput"])
            load.add_metric([stage], row["load"])
        yield peers
        yield throughput
        yield load
        warnings = GaugeMetricFamily("protocol_swarm_warnings", "current warnings by level", labels=["level"])
        levels = {"error": 0, "warning": 0, "info": 0}
        for w in s["warnings"]:
            levels[w["level"]] = levels.get(w["level"], 0) + 1
        for level, n in levels.items():
            warnings.add_metric([level], n)
        yield warnings
        stats = self._stats()
        yield CounterMetricFamily("protocol_tracker_polls", "DHT polls attempted", value=stats["polls"])
        yield CounterMetricFamily(
            "protocol_tracker_poll_failures", "DHT polls that failed", value=stats["poll_failures"]
        )
        yield GaugeMetricFamily(
            "protocol_tracker_last_poll_age_seconds",
            "seconds since the last successful poll",
            value=stats["last_poll_age"],
        )


def make_registry(snapshot: Callable[[], dict[str, Any]], stats: Callable[[], dict[str, float]]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SwarmCollector(snapshot, stats))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
