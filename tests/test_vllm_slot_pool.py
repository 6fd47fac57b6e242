"""kvsim's SlotPool equals the offload pool vLLM 0.33 runs for KvoffloadConnector.

The vLLM side is the real thing where it decides: the ``BlockPool`` and
``KVCacheCoordinator`` of the ``SimpleCPUOffloadScheduler`` that a scheduler-role
``KvoffloadConnector`` builds, and the connector's own ``_drop_slots``. The calls
into them are the ones ``vllm/v1/simple_kv_offload/manager.py`` makes (named on
each method below). Seeded random call sequences (shared prefixes, eviction
pressure, hits touched, loads and stores that fail) go to both; after every call
the results, the loadable blocks with their slots, the free queue order and the
eviction count must be equal.

vLLM's pool keeps block 0 as its null block: a pool of N blocks holds N - 1, so
SlotPool(N - 1) is compared, slot s being vLLM block s + 1.
"""

from __future__ import annotations

import random

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id  # noqa: E402

import kvoffload.vllm as kvv  # noqa: E402
from kvoffload.slot_pool import SlotPool  # noqa: E402
from tests.vllm_harness import BLOCK_SIZE, EngineSpec, engine_configs  # noqa: E402

NUM_SLOTS = 8  # SlotPool's; vLLM's pool has one more (its null block)


class VllmOffloadPool:
    """SlotPool's API over vLLM's own offload pool, making the manager's calls."""

    def __init__(self, mgr) -> None:
        self.mgr = mgr
        self.pool = mgr.cpu_block_pool
        self.in_flight: dict[int, object] = {}  # hash -> vLLM block (the manager's in-flight set)
        self.loads: dict[int, list] = {}  # hash -> blocks its loads hold, oldest first
        self.num_evictions = 0

    @staticmethod
    def _key(h: int):
        return make_block_hash_with_group_id(BlockHash(h.to_bytes(8, "little")), 0)

    def _cached(self, h: int):
        return self.pool.cached_block_hash_to_block.get_one_block(self._key(h))

    def cached_slots(self) -> dict[int, int]:
        out = {}
        for b in self.pool.blocks:
            if b.block_hash is not None:
                out[int.from_bytes(b.block_hash[:8], "little")] = b.block_id - 1
        return out

    def free_queue(self) -> list[int]:
        return [b.block_id - 1 for b in self.pool.free_block_queue.get_all_free_blocks()]

    def lookup(self, hashes: list[int]) -> int:
        # get_num_new_matched_tokens: find_longest_cache_hit over the hashes
        hashes_b = [BlockHash(h.to_bytes(8, "little")) for h in hashes]
        _, hit, _ = self.mgr.cpu_coordinator.find_longest_cache_hit(hashes_b, len(hashes) * BLOCK_SIZE)
        return hit // BLOCK_SIZE

    def touch(self, hashes: list[int]) -> None:
        # get_num_new_matched_tokens touches the hit; update_state_after_alloc
        # releases that pin (_free_pending_cpu_hit) after touching what it loads.
        blocks = [self._cached(h) for h in hashes]
        self.pool.touch(blocks)
        self.pool.free_blocks(blocks)

    def prepare_load(self, hashes: list[int]) -> list[int]:
        # update_state_after_alloc: touch the blocks to load
        blocks = [self._cached(h) for h in hashes]
        self.pool.touch(blocks)
        for h, b in zip(hashes, blocks):
            self.loads.setdefault(h, []).append(b)
        return [b.block_id - 1 for b in blocks]

    def complete_load(self, hashes: list[int], ok: bool) -> None:
        blocks = [self.loads[h].pop(0) for h in hashes]
        for h in hashes:
            if not self.loads[h]:
                del self.loads[h]
        if not ok:  # KvoffloadConnector.update_connector_output, before vLLM's cleanup
            kvv._drop_slots(self.pool, [b.block_id for b in blocks])
        self.pool.free_blocks(blocks)  # _cleanup_load_request

    def prepare_store(self, hashes: list[int]) -> list[tuple[int, int]]:
        # _select_eager_blocks_to_store, then get_new_blocks in _prepare_eager_store_specs
        num_free = self.pool.get_num_free_blocks()
        chosen: list[int] = []
        for h in dict.fromkeys(hashes):
            if self._cached(h) is not None or h in self.in_flight:  # ALREADY_CACHED / IN_FLIGHT
                continue
            if len(chosen) >= num_free:
                break
            chosen.append(h)
        before = len(self.pool.cached_block_hash_to_block)
        blocks = self.pool.get_new_blocks(len(chosen)) if chosen else []
        self.num_evictions += before - len(self.pool.cached_block_hash_to_block)
        self.in_flight.update(zip(chosen, blocks))
        return [(h, b.block_id - 1) for h, b in zip(chosen, blocks)]

    def complete_store(self, hashes: list[int], ok: bool) -> None:
        # _process_store_completion: insert the hashes, free the refs; then
        # KvoffloadConnector drops the slots of a failed store
        blocks = [self.in_flight.pop(h) for h in hashes]
        for h, b in zip(hashes, blocks):
            self.pool._insert_block_hash(self._key(h), b, num_tokens=BLOCK_SIZE)
        self.pool.free_blocks(blocks)
        if not ok:
            kvv._drop_slots(self.pool, [b.block_id for b in blocks])


@pytest.fixture
def vllm_pool(tmp_path):
    def make() -> VllmOffloadPool:
        spec = EngineSpec(disk_slots=NUM_SLOTS + 1, use_page_cache=True)
        vllm_config, kv_cache_config = engine_configs(tmp_path, spec)
        conn = KVConnectorFactory.create_connector(
            config=vllm_config, role=KVConnectorRole.SCHEDULER, kv_cache_config=kv_cache_config)
        assert conn.scheduler_manager.num_cpu_blocks == NUM_SLOTS + 1
        return VllmOffloadPool(conn.scheduler_manager)

    return make


def play(seed: int, pools: list) -> int:
    """One random sequence of calls to every pool; returns how many calls were compared."""
    rng = random.Random(seed)
    # Requests share prefixes: family f's block i has hash f * 100 + i.
    chains = [[f * 100 + i for i in range(rng.randint(2, 7))] for f in range(5)]
    loads: list[list[int]] = []  # in flight, completed oldest first (as kvsim polls)
    stores: list[list[int]] = []
    calls = 0

    def same(results: list) -> None:
        nonlocal calls
        calls += 1
        assert results[0] == results[1], f"seed {seed} call {calls}: {results}"
        assert pools[0].cached_slots() == pools[1].cached_slots(), f"seed {seed} call {calls}"
        assert pools[0].free_queue() == pools[1].free_queue(), f"seed {seed} call {calls}"
        assert pools[0].num_evictions == pools[1].num_evictions, f"seed {seed} call {calls}"

    for _ in range(80):
        op = rng.random()
        chain = rng.choice(chains)
        if op < 0.35:  # a request arrives: look up, load part of the hit, touch the hit
            hit = [p.lookup(chain) for p in pools]
            same(hit)
            n = hit[0]
            if n and rng.random() < 0.7:
                m = rng.randint(1, n)
                same([p.prepare_load(chain[:m]) for p in pools])
                loads.append(chain[:m])
            same([p.touch(chain[:n]) for p in pools])
        elif op < 0.65:  # computed blocks are offered for storing
            upto = rng.randint(1, len(chain))
            got = [p.prepare_store(chain[:upto]) for p in pools]
            same(got)
            if got[0]:
                stores.append([h for h, _ in got[0]])
        elif op < 0.82 and stores:
            batch = stores.pop(rng.randrange(len(stores)))
            ok = rng.random() > 0.15
            same([p.complete_store(batch, ok) for p in pools])
        elif loads:
            ok = rng.random() > 0.2
            batch = loads.pop(0)
            same([p.complete_load(batch, ok) for p in pools])
    return calls


def test_slot_pool_makes_vllms_decisions(vllm_pool) -> None:
    compared = sum(play(seed, [SlotPool(NUM_SLOTS), vllm_pool()]) for seed in range(150))
    assert compared > 150 * 40
