"""The vLLM engine model: prefill queue, chunked batches, steps, parked loads.

Each step boundary (one ``STEP`` event) finishes the running batch, polls offload
completions (once per step, high-water mark), re-admits requests whose load is
done, and forms the next batch the V1 way: running requests first (decode 1 token,
prefill a chunk), then waiting requests in FIFO order while the token budget,
``max_num_seqs`` and free GPU blocks allow. A waiting request whose prefix
continues in the offload tier is parked until its load is seen complete, unless
recomputing would finish sooner (``load_policy="faster"``).
Runs of decode-only steps with nothing else due are fast-forwarded as one event.

With async scheduling (vLLM's default; ``Hardware.async_scheduling``) EngineCore keeps
two batches in flight (``EngineCore.step_with_batch_queue``): when step j ends it takes
step j's output and forms step j+2's batch while step j+1, formed a step earlier, runs.
So a request that arrives while a step runs is admitted (its lookup, its load started) at
that step's end but runs a step later (``LAG_ARRIVAL``), and a finished load, which the
worker finds when it launches step j+2 (``get_finished`` right after the forward is
queued, at step j's end), reaches the scheduler with step j+2's output and runs in step
j+4 (``LAG_LOADED``); a request finished in step j frees its blocks for step j+2's batch.
An engine with nothing running has no batch in flight and takes a request at once.
"""

from __future__ import annotations

import math
import heapq
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

from kvsim.events import Event, Kind
from kvsim.gpu import GpuProfile
from kvsim.gpu_cache import GpuPrefixCache
from kvsim.hardware import Hardware
from kvsim.models import ModelShape
from kvsim.request import Request, prompt_units
from kvsim.tiering import Tier

LOAD_POLICIES = ("always", "faster")
# Step boundaries between seeing a request and the first batch that may hold it, under
# async scheduling (module docstring): one after an arrival, three after a finished load.
LAG_ARRIVAL, LAG_LOADED = 1, 3


@dataclass(slots=True)
class Batch:
    prefills: list[tuple[Request, int]] = field(default_factory=list)
    decodes: list[Request] = field(default_factory=list)
    decode_ctx: int = 0  # tokens the decodes attend to
    steps: int = 1  # > 1: fast-forwarded decode-only steps


class Engine:
    def __init__(
        self,
        model: ModelShape,
        hw: Hardware,
        tier: Optional[Tier],
        next_arrival: Callable[[], Optional[int]],
        load_policy: str,
        gpu: GpuProfile,
    ) -> None:
        if load_policy not in LOAD_POLICIES:
            raise ValueError(f"load_policy must be one of {LOAD_POLICIES}, got {load_policy!r}")
        self.model, self.hw, self.tier, self.profile = model, hw, tier, gpu
        self.bs = hw.block_size
        # vLLM's GPU BlockPool keeps block 0 as its null block: it holds no KV.
        self.gpu = GpuPrefixCache(hw.kv_bytes(model, gpu) // (model.kv_bytes_per_token * self.bs) - 1)
        # A fast-forward stops before anything that could change the batch: the next
        # arrival (the router may send it here) or this engine's own IO completions.
        self._next_arrival = next_arrival
        self._io_due: list[int] = []  # times of this engine's pending IO_DONE events
        self.load_policy = load_policy
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_parked = 0
        self.finished: list[Request] = []
        self._freed_next: list[Request] = []  # finished, blocks freed at the next boundary
        # Waiting requests that may not run yet (runnable_at past the boundary), and some that
        # may by now: the few that entered waiting lately, so that no step scans the queue.
        self._not_yet: list[Request] = []
        self.rejected: list[Request] = []
        self._busy = False  # a STEP event is pending
        self._step_ns = 0  # when it is due: later than now while a batch runs
        self._last_step_ns = 0  # one step of the last batch
        self._waiting_tokens = 0  # prompt tokens of waiting requests not yet admitted
        self._seen: set[int] = set()  # units ever computed: a later miss is a recompute
        self.num_steps = 0
        self.boundary = 0  # step boundaries so far (STEP events): what runnable_at counts
        self.busy_ns = 0  # steps' time, fast-forwarded ones included: how loaded the GPU was

    # -- time model (gpu.py) ----------------------------------------------------

    def prefill_ns(self, n_new: int, n_ctx: int) -> int:
        """A lone prefill's GPU time, for the load-or-recompute choice."""
        return round(self.profile.prefill_s(self.model, self.hw.tp, n_new, n_ctx) * 1e9)

    def recompute_eta_ns(self, n_new: int, n_ctx: int) -> int:
        """When recomputing would be done if the GPU first drained the queued prefills.

        A saturated GPU makes every recompute wait for (or delay) the queue, while a
        load costs the GPU nothing, so the queue counts against recomputing; the
        backlog is priced at the linear (weights) FLOPs, without attention.
        """
        backlog = self._waiting_tokens + sum(r.prompt - r.computed for r in self.running)
        return self.prefill_ns(n_new, n_ctx) + round(backlog * self.profile.token_s(self.model, self.hw.tp) * 1e9)

    # -- event handlers ---------------------------------------------------------

    def on_arrival(self, ev: Event) -> list[Event]:
        req: Request = ev.payload
        need = self._blocks_needed(req)
        if need > self.gpu.num_blocks:
            self.rejected.append(req)  # could never fit, would block the queue forever
            return []
        # While a batch runs, the one after it is formed already; idle (or about to form
        # one now), the engine takes the request into its next batch.
        running = self._busy and self._step_ns > ev.time_ns
        req.runnable_at = self.boundary + 1 + (LAG_ARRIVAL if running and self.hw.async_scheduling else 0)
        self._not_yet.append(req)
        self.waiting.append(req)
        self._waiting_tokens += req.prompt
        return self._kick(ev.time_ns)

    def on_io_done(self, ev: Event) -> list[Event]:
        # Only an idle engine cares: a busy one polls at its next step boundary.
        return self._kick(ev.time_ns) if self.num_parked or self.waiting else []

    def _kick(self, now: int) -> list[Event]:
        if self._busy:
            return []
        self._busy = True
        self._step_ns = now
        return [Event(now, Kind.STEP, target=self)]

    def _next_event(self, now: int) -> Optional[int]:
        due = self._io_due
        while due and due[0] <= now:  # handled already: IO completions come before steps at one instant
            heapq.heappop(due)
        arrival = self._next_arrival()
        if not due:
            return arrival
        return due[0] if arrival is None else min(due[0], arrival)

    def on_step(self, ev: Event) -> list[Event]:
        now = ev.time_ns
        self.boundary += 1
        out: list[Event] = []  # the tier's polling may start transfers (a second hop)
        resumed = []
        if self.tier is not None:
            # Polled before the batch's finished requests free their blocks: a store done
            # during a fast-forwarded run of decode steps was seen at one of its boundaries.
            released: list = []
            resumed = self.tier.poll(now, out, released)
            self.gpu.unpin(released)
        for r in self._freed_next:  # their output reached the scheduler a step ago
            self._free(r)
        self._freed_next = []
        if ev.payload is not None:
            self._finish_batch(now, ev.payload)
        for req in resumed:
            self._resume(req, now)
            req.runnable_at = self.boundary + (LAG_LOADED if self.hw.async_scheduling else 0)
        self._not_yet += resumed
        self.waiting.extendleft(reversed(resumed))
        if not self.running:  # no batch in flight: nothing stands between a request and the GPU
            for r in self.waiting:
                r.runnable_at = min(r.runnable_at, self.boundary)
        batch, dur = self._schedule(now, out)
        for e in out:  # the IO completions this step started (loads, a second hop)
            e.target = self
            heapq.heappush(self._io_due, e.time_ns)
        if batch is None:
            self._busy = False
            if self.waiting and self.tier is not None:
                # Waiting requests blocked by GPU blocks that stores still hold: nothing else
                # would wake the engine when the first store is done (stores send no event).
                done = self.tier.first_store_done()
                if done is not None and done > now:
                    out.append(Event(done, Kind.IO_DONE, target=self))
            return out
        self.num_steps += batch.steps
        self.busy_ns += dur
        self._last_step_ns = dur // batch.steps
        self._step_ns = now + dur
        out.append(Event(now + dur, Kind.STEP, payload=batch, target=self))
        return out

    # -- batches ----------------------------------------------------------------

    def _schedule(self, now: int, out: list[Event]) -> tuple[Optional[Batch], int]:
        hw = self.hw
        budget = hw.max_num_batched_tokens
        batch = Batch()
        # The hottest loop of a replay: locals only.
        prefills, decodes, chunked, ctx = batch.prefills, batch.decodes, hw.chunked_prefill, 0
        bs = self.bs
        for r in self.running:
            left = r.prompt - r.computed
            if left:
                n = left if left < budget else budget
                if n and (chunked or n == left):
                    prefills.append((r, n))
                    self._take(r, r.computed + n)
                    self._publish(r, r.units.within((r.computed + n) // bs))
                    budget -= n
            elif budget:
                decodes.append(r)
                fed = r.prompt + r.generated  # with the KV of the token it feeds
                if fed > r.num_held * bs:
                    self._take(r, fed)
                ctx += fed
                budget -= 1
        batch.decode_ctx = ctx
        waiting, boundary, i = self.waiting, self.boundary, 0
        while i < len(waiting) and budget and len(self.running) < hw.max_num_seqs:
            r = waiting[i]
            fresh = not r.allocated
            if fresh:
                state = self._admit(now, r, out)
                if state == "blocked":
                    break
                if state == "parked":
                    r.runnable_at = 0  # out of waiting until its load is seen (which sets it anew)
                    del waiting[i]
                    continue
            left = r.prompt - r.computed
            n = min(left, budget)
            if r.runnable_at > boundary:
                # Not in this step's batch (async scheduling). One admitted just now goes
                # into the batch after: that batch's budget, which this one's remainder
                # stands for, bounds how many are admitted; a loaded one takes none until it runs.
                if fresh:
                    budget -= n
                i += 1
                continue
            if not hw.chunked_prefill and n < left:
                break
            del waiting[i]
            self.running.append(r)
            batch.prefills.append((r, n))
            self._take(r, r.computed + n)
            self._publish(r, r.units.within((r.computed + n) // bs))
            budget -= n
        if not batch.prefills and not batch.decodes:
            return None, 0
        # A load started in this step has its completion in ``out``, not yet in the
        # loop's queue: a fast-forward must stop for it too.
        due = [e.time_ns for e in out]
        self._not_yet = [r for r in self._not_yet if r.runnable_at > boundary]  # runnable_at never grows in waiting
        if self._not_yet or self._freed_next:
            due.append(now)  # one step at a time until they may run (or blocks free): no fast-forward
        queued = self._next_event(now)
        if queued is not None:
            due.append(queued)
        return batch, self._batch_ns(now, batch, min(due, default=None))

    def _batch_ns(self, now: int, batch: Batch, t_next: Optional[int]) -> int:
        m = self.model
        n_dec = len(batch.decodes)
        ctx = batch.decode_ctx
        kvb = m.kv_bytes_per_token
        dur = self._single_step_ns(batch)
        if batch.prefills or not n_dec:
            return dur
        # Decode only: take further steps while no event falls before a boundary,
        # since nothing could change the batch then; stop before the first finish.
        # Only the KV read grows from step to step (gpu.py's decode_parts): it runs for most steps.
        limit = min(r.output - r.generated for r in batch.decodes)
        const, per_kv_byte = self.profile.decode_parts(m, self.hw.tp, n_dec, n_dec, n_dec)
        end = math.inf if t_next is None else t_next - now
        total, steps = dur, 1
        while steps < limit and total < end:
            ctx += n_dec
            total += self.profile.with_host_ns(const + ctx * kvb * per_kv_byte)
            steps += 1
        batch.steps = steps
        return total

    def _resume_after_ns(self, load_ns: int) -> int:
        """How long until a load taking ``load_ns`` is seen complete.

        The worker polls at step boundaries, so a load is seen at the first boundary
        after it; steps are taken as long as the last one. (Which steps will run is
        not known yet: an arrival may start a long prefill while the load runs. Of
        the last step, the mean step so far and the step being formed, the last step
        predicted best on the reload scenario and the Mooncake trace.)
        """
        step = self._last_step_ns
        return -(-load_ns // step) * step if step else load_ns

    def _single_step_ns(self, batch: Batch) -> int:
        if not batch.prefills and not batch.decodes:
            return 0
        m = self.model
        attn = sum(m.attention_flops(n, r.computed) for r, n in batch.prefills)
        n_dec = len(batch.decodes)
        tokens = sum(n for _, n in batch.prefills) + n_dec
        return self.profile.step_ns(m, self.hw.tp, tokens, len(batch.prefills) + n_dec, attn,
                                    batch.decode_ctx * m.kv_bytes_per_token, n_dec)

    def _blocks_needed(self, r: Request) -> int:
        """GPU blocks a request ever holds: one KV slot per token it feeds, the prompt and
        every output token but the last (sampled, never fed back)."""
        return math.ceil((r.prompt + r.output - 1) / self.bs)

    def _take(self, r: Request, tokens: int) -> None:
        """Take from its reservation the blocks the KV of its first ``tokens`` tokens needs,
        when vLLM would allocate them (the step that computes or loads them)."""
        n = min(r.num_reserved, -(-tokens // self.bs) - r.num_held)
        if n > 0:
            self.gpu.take(n)
            r.num_reserved -= n
            r.num_anon += n
            r.num_held += n

    def _admit(self, now: int, r: Request, out: list[Event]) -> str:
        """Allocate GPU blocks for a waiting request; ``blocked``, ``parked`` or ``ready``."""
        bs = self.bs
        if r.units is None:
            r.units = prompt_units(r.trace, bs)
        u = r.units
        keys = u.keys
        # vLLM always computes the last prompt token, so a full hit leaves some blocks.
        cap = u.within((r.prompt - 1) // bs)
        g = min(self.gpu.lookup(keys), cap)
        hit = u.blocks(g)
        total = self._blocks_needed(r)
        if not self.gpu.can_allocate(keys[:g], total - hit):
            return "blocked"
        r.owned = self.gpu.allocate(keys[:g], total - hit)
        self._waiting_tokens -= r.prompt
        r.allocated = True
        r.admitted_ns = now
        r.num_reserved = total - hit
        r.num_held = hit
        r.published = g
        r.computed = hit * bs
        r.gpu_hit_blocks = hit
        m = 0
        tier = self.tier
        if tier is not None and g < cap:
            m = tier.lookup(keys[g:cap])
        if m:
            plan = tier.prepare_load(keys[g : g + m], [u.weight(i) for i in range(g, g + m)])  # pins
            m = len(plan.keys)  # a two-level tier may hold less (no CPU room to promote into)
        if m:
            # Each hop is seen at the step boundary after it; the next hop starts there.
            eta = sum(self._resume_after_ns(t) for t in tier.load_eta_ns(now, plan))
            n_load = u.blocks(g + m) - hit
            # A load seen complete still waits LAG_LOADED steps for its batch (async scheduling).
            lag = LAG_LOADED * self._last_step_ns if self.hw.async_scheduling else 0
            if self.load_policy == "faster" and eta + lag > self.recompute_eta_ns(n_load * bs, hit * bs):
                tier.cancel_load(plan)  # unpin: recompute instead
                m = 0
            else:
                self._take(r, (hit + n_load) * bs)  # the blocks the load writes into
                out.append(tier.load(now, plan, r))
                r.load_blocks = n_load
                r.load_eta_ns = now + eta
        if m:  # vLLM touches the hit past the GPU prefix hit, not the GPU-hit part
            tier.touch(keys[g : g + m])
        seen = self._seen
        s = 0
        for k in keys[:cap]:
            if k not in seen:
                break
            s += 1
        r.recomputed_tokens = max(0, u.blocks(s) - u.blocks(g + m)) * bs
        seen.update(keys)
        if m:
            self.num_parked += 1
            return "parked"
        return "ready"

    def _resume(self, r: Request, now: int) -> None:
        """A load is seen complete: its blocks are computed tokens now."""
        self.num_parked -= 1
        r.resumed_ns = now
        self._publish(r, r.units.within(r.gpu_hit_blocks + r.load_blocks))
        r.computed = (r.gpu_hit_blocks + r.load_blocks) * self.bs

    def _publish(self, r: Request, upto: int) -> None:
        """Cache the request's units before ``upto`` on the GPU. vLLM caches a block when
        the step that computes it is scheduled (``KVCacheManager.allocate_slots``), so a
        request scheduled later in the same step already hits it; the offload tier is
        offered a unit only once it is computed (``_finish_batch``)."""
        gpu, u, owned = self.gpu, r.units, r.owned
        keys, last = u.keys, len(u.keys) - 1
        for i in range(r.published, upto):
            w = u.last if i == last else u.per_unit
            owned.append(gpu.publish(keys[i], w))
            r.num_anon -= w
        r.published = upto

    def _free(self, r: Request) -> None:
        self.gpu.free(r.owned, r.num_anon, r.num_reserved)
        r.units = None
        r.owned = []

    def _finish_batch(self, now: int, batch: Batch) -> None:
        bs, tier = self.bs, self.tier
        for r, n in batch.prefills:
            r.computed += n
            upto = r.units.within(r.computed // bs)
            if tier is not None and upto > r.offered:  # eager: every newly computed unit, once
                self.gpu.pin(tier.store(now, r.units, r.offered, upto, r.owned[r.offered:upto]))
                r.offered = upto
            if r.computed == r.prompt:
                r.first_token_ns = now
                r.generated = 1
        for r in batch.decodes:
            r.generated += batch.steps
            # A fast-forward's later steps took their blocks too; nothing else ran meanwhile.
            if r.prompt + r.generated - 1 > r.num_held * bs:
                self._take(r, r.prompt + r.generated - 1)
        # Only a request in this batch can have finished with it.
        done = [r for r, _ in batch.prefills if r.computed == r.prompt and r.generated >= r.output]
        done += [r for r in batch.decodes if r.generated >= r.output]
        if not done:
            return
        for r in done:
            r.finish_ns = now
            self.finished.append(r)
            if self.hw.async_scheduling and len(self.running) > len(done):
                # The batch after this one was formed before this output: the blocks serve
                # the one after it (an engine with nothing left running frees them now).
                self._freed_next.append(r)
            else:
                self._free(r)
        self.running = [r for r in self.running if r.finish_ns is None]
