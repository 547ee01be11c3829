"""The tracker's DHT node relays trips for peers behind NAT (issue 15).

The tracker's node is the one node every run has on a public address, and every peer connects to it first
(it is the bootstrap), so a NATed peer can always hold a relay here even when no public peer offers one.
It runs the same carrying side as a public peer (`p2pio.relay_service.RelayService`, the same budget flags),
on a replica of the DHT's libp2p daemon, in an event loop of its own: the tracker's HTTP server and its DHT
poller are threads of their own too, and none of them waits on the others. Its counters are logged as one
line per interval while they change.
"""

from __future__ import annotations

import asyncio
import logging
import threading

from p2pio.relay_service import Budget, RelayService
from swarm.manifest import Manifest
from swarm.wire import expectation_for

logger = logging.getLogger("tracker")

START_TIMEOUT = 30.0


class TrackerRelay:
    def __init__(self, dht, manifest: Manifest, budget: Budget):
        self.dht, self.manifest, self.budget = dht, manifest, budget
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="tracker-relay", daemon=True)
        self.service: RelayService | None = None
        self.log_task: asyncio.Task | None = None

    def start(self) -> None:
        """Serve the relay's handlers on the DHT's daemon; raises if that does not work within START_TIMEOUT."""
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(START_TIMEOUT)

    async def _start(self) -> None:
        p2p = await self.dht.replicate_p2p()
        max_message = expectation_for(self.manifest, 0, "forward", 0, "").max_bytes
        self.service = RelayService(p2p, self.manifest.run_id, self.budget, max_message)
        await self.service.add_handlers()
        self.log_task = asyncio.create_task(self.service.log_loop(lambda: "[tracker]"))
        logger.info(
            "relaying trips for peers behind NAT: %d at once per sender, %d MiB and %.0f s per trip",
            self.budget.circuits_per_peer, self.budget.bytes_per_circuit >> 20, self.budget.seconds_per_circuit,
        )

    def stop(self) -> None:
        if self.log_task is not None:
            self.loop.call_soon_threadsafe(self.log_task.cancel)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
