"""Engine: one model replica. `add_request` / `step` / `abort`, nano-vllm shaped:

out = scheduler.schedule()              # who runs, how many tokens; out.plan is the step plan
running = executor.submit(out.plan)     # every rank: cache ops, forward; rank 0 samples
scheduler.advance(out)                  # cursors past the chunks, commits
scheduler.settle(out, running.result().samples)   # tokens, stop checks, forks, freeing

With async scheduling (`async_scheduling`) the next step is scheduled and submitted between
`advance` and `settle`: its requests' inputs are placeholders that the rank fills from the
samples it just drew, and the engine learns those tokens one step late.

The executor runs the plan on one rank in this process (`uni`) or on `tensor_parallel_size`
ranks (`mp`: rank 0 here, the others in their own processes). If a rank dies or hangs, every
request ends with that error and the engine refuses new ones (`dead`).

A disaggregated engine has one port for its role (workers/disaggregation/): `prefill_port` on
a prefill engine (requests handed off after their first token), `decode_port` on a decode
engine (requests received from one); the other is None.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from concurrent.futures import Future, wait

from hybridserve.kernels.cpu.gemm import GEMV_ROWS
from hybridserve.workers.cache.coordinator import CacheCoordinator, PrefixCachingConfig
from hybridserve.workers.cache.events import CacheEventSink
from hybridserve.workers.core.config import EngineConfig
from hybridserve.workers.core.outputs import RequestOutput
from hybridserve.workers.core.request import CHOICE_SEPARATOR, Request, RequestStatus
from hybridserve.workers.core.sampling_params import SamplingParams
from hybridserve.workers.core.scheduler import Scheduler, SchedulerOutput
from hybridserve.workers.core.step_plan import StepPlan, mix_seed
from hybridserve.workers.core.structured_output import Grammar, GrammarCompiler
from hybridserve.workers.core.tokenizer import Tokenizer
from hybridserve.workers.disaggregation.decode_port import DecodePort
from hybridserve.workers.disaggregation.layout import peer_layout
from hybridserve.workers.disaggregation.prefill_port import PrefillPort
from hybridserve.workers.executors.executor import RankFailure, create_executor
from hybridserve.workers.models.loader import open_checkpoint
from hybridserve.workers.runner.forward_batch import StateCaches
from hybridserve.workers.runner.model_runner import RunnerOutput
from hybridserve.workers.runner.precision import resolve_precision
from hybridserve.workers.speculative.draft_model import DraftModelProposer, check_draft_model
from hybridserve.workers.speculative.mtp import MTPProposer
from hybridserve.workers.speculative.proposer import (
    NgramProposer,
    Proposer,
    Speculator,
    hold_drafts,
)

logger = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 8192


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        checkpoint = open_checkpoint(config.model, config.load_format)
        # Concrete dtypes before anything (the ranks, the transfer layout) reads them.
        config = resolve_precision(config, checkpoint.raw_config)
        self.config = config
        self.model_config = checkpoint.config
        self.tokenizer: Tokenizer | None = checkpoint.tokenizer
        self.eos_token_ids = frozenset(checkpoint.eos_token_ids)
        self.grammars = (
            None
            if self.tokenizer is None
            else GrammarCompiler(
                self.tokenizer, checkpoint.config.vocab_size, sorted(self.eos_token_ids)
            )
        )
        model_max = self.model_config.max_position_embeddings
        self.max_model_len = config.max_model_len or min(model_max, DEFAULT_MAX_MODEL_LEN)
        if self.max_model_len > model_max:
            raise ValueError(
                f"max_model_len={self.max_model_len} is longer than the model's "
                f"max_position_embeddings={model_max}"
            )
        spec = config.speculative_config
        if spec is not None and spec.model is not None:
            check_draft_model(spec.model, self.model_config.vocab_size, self.max_model_len)
        if spec is not None and spec.method == "mtp":
            self._check_mtp(config)
        self.executor = create_executor(config, checkpoint, self.max_model_len)
        sizes = self.executor.sizes
        # Why the engine stopped (a rank died or hung); it then refuses new requests.
        self.dead: str | None = None
        prefix = PrefixCachingConfig(
            enabled=config.enable_prefix_caching,
            snapshot_interval=config.snapshot_interval,
            save_last_snapshot=config.save_last_snapshot,
            partial_reuse=config.enable_partial_reuse,
            offsets_from_start=config.snapshot_offsets_from_start,
            offsets_from_end=config.snapshot_offsets_from_end,
            requires_snapshot=self.model_config.num_recurrent_layers > 0,
            snapshot_turn_end=config.snapshot_turn_end,
        )
        self.cache = CacheCoordinator(
            num_blocks=sizes.num_kv_blocks,
            block_size=config.block_size,
            num_live_slots=config.num_live_slots,
            num_snapshot_slots=config.num_snapshot_slots,
            num_checkpoint_slots=config.num_checkpoint_slots,
            prefix=prefix,
            host_blocks=sizes.num_host_blocks,
            host_slots=sizes.num_host_slots,
        )
        if prefix.enabled and config.num_snapshot_slots == 0 and prefix.requires_snapshot:
            logger.warning(
                "prefix caching is on but num_state_slots leaves no snapshot slots: "
                "nothing will be reusable"
            )
        self._sinks: list[CacheEventSink] = []
        self.scheduler = Scheduler(
            self.cache,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            fork_on_sample=config.role != "prefill",
            # A prefill engine hands each request off after its first token: nothing to
            # speculate there.
            speculator=self._speculator(),
        )
        # Each rank's state, as the transceiver describes it (rank 0's is this process's).
        self.layouts = [
            peer_layout(self.model_config, config, rank)
            for rank in range(config.tensor_parallel_size)
        ]
        self.layout = self.layouts[0]
        # Live requests by id: queued, running, handed off or receiving.
        self.requests: dict[str, Request] = {}
        self.num_requests_aborted = 0  # live requests (choices included) `abort` stopped
        compatibility = self.layout.compatibility_hash()
        self.prefill_port = (
            PrefillPort(
                self,
                lease_seconds=config.transfer_lease_seconds,
                compatibility_hash=compatibility,
            )
            if config.role == "prefill"
            else None
        )
        self.decode_port = (
            DecodePort(
                self,
                compatibility_hash=compatibility,
                failure_policy=config.transfer_failure_policy,
            )
            if config.role == "decode"
            else None
        )
        # Outputs produced outside `step` (a failed receive under policy "fail", the choices a
        # completed receive forks): they go out with the next step.
        self._ended: list[RequestOutput] = []
        # Async scheduling: the step handed to the ranks before the last one's tokens were
        # known, and its result to come.
        self._ahead: tuple[SchedulerOutput, Future[RunnerOutput]] | None = None
        self._ids = itertools.count()
        logger.info(
            "engine ready: %s (%s, %d layers), max_model_len=%d, device=%s, tp=%d (%s)",
            checkpoint.name,
            self.model_config.architecture,
            len(self.model_config.layer_kinds),
            self.max_model_len,
            self.executor.driver.device,
            config.tensor_parallel_size,
            config.executor_backend,
        )

    def _check_mtp(self, config: EngineConfig) -> None:
        """Refuse MTP speculation on a checkpoint without the layers, before anything
        starts."""
        if not self.model_config.num_mtp_steps:
            raise ValueError(
                f"speculative_config: method 'mtp' needs the checkpoint's multi-token-"
                f"prediction layers, and {config.model} declares none (Qwen3.5: "
                "mtp_num_hidden_layers; Qwen3-Next: num_nextn_predict_layers; NemotronH: "
                "mtp_hybrid_override_pattern)"
            )

    def _speculator(self) -> Speculator | None:
        """The scheduler's speculator (None: this engine does not speculate)."""
        spec = self.config.speculative_config
        if spec is None or not self.config.num_checkpoint_slots:
            return None
        max_batch = spec.disable_by_batch_size
        device = self.executor.driver.device
        if max_batch is None and device.type == "cpu":
            # Past the rows a mat-vec multiplies for one read of the weights, a small CPU's
            # step is compute-bound and drafts cost their rows in full
            # (docs/speculative-decoding.md has the measurements).
            max_batch = max(1, GEMV_ROWS // (spec.num_speculative_tokens + 1))
        proposer: Proposer
        if spec.method == "draft_model":
            proposer = DraftModelProposer(self.config, self.max_model_len, device.type)
        elif spec.method == "mtp":
            proposer = MTPProposer(spec.num_speculative_tokens)
        else:
            proposer = NgramProposer(spec)
        return Speculator(spec, proposer, max_batch)

    @property
    def num_kv_blocks(self) -> int:
        return self.executor.sizes.num_kv_blocks

    @property
    def caches(self) -> StateCaches:
        """Rank 0's state pools (all of the state at tensor_parallel_size 1)."""
        return self.executor.driver.caches

    # ---- requests -------------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this checkpoint has no tokenizer.json: pass token ids")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
        stable_prompt_len: int | None = None,
        system_prompt_len: int | None = None,
    ) -> str:
        """Queue a request; returns its id. Everything is validated before anything is
        allocated, so a bad request raises ValueError and leaves the engine untouched.

        With `params.n` > 1 the request's choices fork from it once its prompt is computed;
        their outputs carry `index` and `parent_request_id`, and ids "<id>#<index>"."""
        self.raise_if_dead()
        params = params or SamplingParams()
        if request_id is None:
            # NOTE: a caller may already use an id of our "req-N" form for a live request.
            request_id = next(i for i in (f"req-{n}" for n in self._ids) if not self._in_use(i))
        if self._in_use(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        if CHOICE_SEPARATOR in request_id:
            raise ValueError(
                f"request id {request_id!r} contains {CHOICE_SEPARATOR!r}, which names the "
                "choices of n > 1 requests"
            )
        if params.stop:
            raise ValueError(
                f"request {request_id}: stop strings are matched where text is made (LLM, the "
                "OpenAI server); the engine stops on stop_token_ids"
            )
        token_ids = self.tokenize(prompt)
        self._validate_prompt(request_id, token_ids)
        self._validate_params(request_id, params)
        grammar = self.grammar(params)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        request = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            stop_token_ids=frozenset(stop_ids),
            sample_seed=self._seed(params, request_id, 0),
            cache_salt=cache_salt,
            stable_prompt_len=stable_prompt_len,
            system_prompt_len=system_prompt_len,
            choice_seeds=tuple(
                self._seed(params, request_id, index) for index in range(1, params.n)
            ),
            grammar=grammar,
        )
        self.requests[request_id] = request
        self.scheduler.add(request)
        return request_id

    def _seed(self, params: SamplingParams, request_id: str, index: int) -> int:
        """Choice `index`'s sampling seed: seed + index, or derived from the engine seed and
        the choice's id (so choice 0 of an n > 1 request draws as the same request with n =
        1)."""
        seed = params.choice_seed(index)
        if seed is not None:
            return seed
        choice_id = request_id if index == 0 else f"{request_id}{CHOICE_SEPARATOR}{index}"
        digest = hashlib.blake2b(choice_id.encode(), digest_size=8).digest()
        return mix_seed(self.config.seed, int.from_bytes(digest, "little"))

    def _validate_params(self, request_id: str, params: SamplingParams) -> None:
        vocab = self.model_config.vocab_size
        for name, ids in (
            ("logit_bias", [t for t, _ in params.logit_bias]),
            ("stop_token_ids", list(params.stop_token_ids)),
        ):
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise ValueError(
                    f"request {request_id}: {name} names token id {bad}, outside the "
                    f"vocabulary [0, {vocab})"
                )
        limit = vocab if self.config.max_logprobs == -1 else self.config.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > limit:
                raise ValueError(
                    f"request {request_id}: {name}={value} is more than this engine returns "
                    f"(max_logprobs={limit})"
                )

    def grammar(self, params: SamplingParams) -> Grammar | None:
        """The request's output constraint compiled (None without one); ValueError for a bad
        one."""
        if params.structured_output is None:
            return None
        if self.grammars is None:
            raise ValueError("structured output needs the checkpoint's tokenizer.json")
        return self.grammars.compile(params.structured_output)

    def _validate_prompt(self, request_id: str, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError(f"request {request_id}: the prompt is empty")
        if len(token_ids) > self.max_model_len:
            raise ValueError(
                f"request {request_id}: the prompt has {len(token_ids)} tokens, "
                f"more than max_model_len={self.max_model_len}"
            )
        vocab = self.model_config.vocab_size
        bad = next(
            (
                t
                for t in token_ids
                if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab
            ),
            None,
        )
        if bad is not None:
            raise ValueError(
                f"request {request_id}: token id {bad!r} is outside the vocabulary [0, {vocab})"
            )

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request (every choice of it) wherever it is and release what it holds;
        the output of `request_id` itself, or None if unknown."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self.num_requests_aborted += 1
        if request.status is RequestStatus.HANDED_OFF and self.prefill_port is not None:
            # Its pages go now, or after the send that still reads them.
            self.prefill_port.release(request_id, "aborted")
            request.finish_reason = "abort"
        else:
            if request.status is RequestStatus.RECEIVING and self.decode_port is not None:
                self.decode_port.abort(request_id, "aborted")
            if not request.is_finished:
                self.scheduler.finish(request, "abort")
        for choice in [r for r in self.requests.values() if r.parent_id == request_id]:
            self.abort(choice.request_id)
        self.publish_cache_events()
        return request.to_output()

    def stop(self, request_id: str) -> None:
        """End one running request (one choice) as stopped: its caller found a stop string in
        its text. Its output comes with the next step."""
        request = self.requests.get(request_id)
        if request is not None and not request.is_finished:
            self.scheduler.finish(request, "stop")
            self.emit(request)

    def _in_use(self, request_id: str) -> bool:
        """Live here, or an aborted handoff whose pages a send still reads (its id is taken
        until they are freed)."""
        return request_id in self.requests or (
            self.prefill_port is not None and self.prefill_port.holds(request_id)
        )

    def has_request(self, request_id: str) -> bool:
        """Whether `request_id` is live here (queued, running, handed off or receiving)."""
        return request_id in self.requests

    def has_unfinished_requests(self) -> bool:
        """Requests to step, outputs to deliver, or a step that ran ahead to settle."""
        return self.scheduler.has_unfinished() or bool(self._ended) or self._ahead is not None

    # ---- stepping -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one model step; returns an output for every request that got a token.

        With async scheduling, the step this call settles may have gone to the ranks in the
        call before, and the next one goes to them before this one's tokens are known
        (`Scheduler.run_ahead`); the engine's thread then schedules and settles while the
        ranks compute."""
        if self.dead is not None:
            return self._take_ended()
        # NOTE: first, and on idle steps too: expired leases and quarantines must free their
        # pages whether or not anything can be scheduled.
        self._sweep_transfers()
        ended = self._take_ended()
        if self._ahead is not None:
            out, ahead = self._ahead
            running: Future[RunnerOutput] | RunnerOutput = ahead
            self._ahead = None
        else:
            out = self.scheduler.schedule()
            if not out.scheduled:
                if self.scheduler.has_unfinished() and not self.has_pending_transfers():
                    raise RuntimeError(
                        "no request could be scheduled: the caches cannot hold even "
                        "one request; this is a sizing bug"
                    )
                self._execute(out.plan)  # data moves only (if any), e.g. a finished commit's
                return ended  # otherwise waiting for transfers to release their pages
            submitted = self._submit(out)
            if submitted is None:
                return ended + self._take_ended()  # a rank failed: every request ended
            running = submitted
        if self._runs_ahead(out):
            self.scheduler.run_ahead(out)
            following = self.scheduler.schedule()
            if following.scheduled:
                submitted = self._submit(following)
                if isinstance(submitted, Future):  # async scheduling: it runs on its own
                    self._ahead = (following, submitted)
            else:
                self._execute(following.plan)  # its data moves, in order
        result = self._wait(running)
        if result is None:
            return ended + self._take_ended()
        outputs = ended + self._settle(out, result)
        self._sweep_transfers()
        self.publish_cache_events()
        if not self.scheduler.has_unfinished():
            # Idle. A step that ran ahead of the last tokens computed for requests that have
            # ended since: nothing to take from it.
            if self._ahead is not None:
                self._wait(self._ahead[1])
                self._ahead = None
            # Apply what the last commits decided now, so the pools are complete while
            # nothing steps (a snapshot read by a test or a benchmark, a transfer).
            self.apply_decided_ops()
            self.cache.check_integrity()
            try:
                if self.dead is None:
                    self.executor.check_ranks()
            except RankFailure as exc:
                self._die(str(exc))
        return outputs + self._take_ended()

    def _runs_ahead(self, out: SchedulerOutput) -> bool:
        """Whether the next step goes to the ranks before `out`'s tokens are known (a prefill
        engine hands each request off with its first token: it never runs ahead)."""
        return (
            self.config.async_scheduling
            and self.prefill_port is None
            and self.dead is None
            and self.scheduler.can_run_ahead(out)
        )

    def _submit(self, out: SchedulerOutput) -> Future[RunnerOutput] | RunnerOutput | None:
        """Hand `out`'s plan to the ranks and advance its cursors: its result to come (async
        scheduling) or already there; None if a rank failed."""
        try:
            # NOTE: without async scheduling the plan runs now. A Future per step cost
            # conformance runs ~15% more CPU time: its lock and condition are garbage for the
            # collector, which then walks the whole heap more often.
            running = (
                self.executor.submit(out.plan)
                if self.config.async_scheduling
                else self.executor.execute(out.plan)
            )
        except RankFailure as exc:
            self._die(str(exc))
            return None
        self.scheduler.advance(out)
        return running

    def _wait(self, running: Future[RunnerOutput] | RunnerOutput) -> RunnerOutput | None:
        """A submitted step's result; None if a rank failed (the engine is dead then)."""
        if isinstance(running, RunnerOutput):
            return running
        try:
            return running.result()
        except RankFailure as exc:
            if self.dead is None:
                self._die(str(exc))
            return None

    def _settle(self, out: SchedulerOutput, result: RunnerOutput) -> list[RequestOutput]:
        """Take a step's result: prompt scores, MTP drafts, then the sampled tokens (the
        outputs of the requests that got one or ended)."""
        for item, chunk in zip(out.scheduled, out.plan.chunks, strict=True):
            scored = result.prompt_logprobs.get(chunk.request_id)
            if scored:
                item.request.record_prompt_logprobs(chunk.start, scored)
        for request_id, drafts in result.drafts.items():
            # MTP guesses for the next step, made after this one (its tokens appended below;
            # a prefill engine hands them over with the request).
            request = self.requests.get(request_id)
            if request is not None:
                hold_drafts(request, drafts)
        outputs = []
        for request in self.scheduler.settle(out, result.samples):
            outputs.append(self._output(request))
            if request.is_finished:
                continue
            if self.prefill_port is not None and request.num_output_tokens == 1:
                # Prefill role: the prompt is done and the first token sampled; decode
                # continues elsewhere from exactly this state.
                self.prefill_port.hand_off(request)
        return outputs

    def _execute(self, plan: StepPlan) -> RunnerOutput | None:
        """Run a plan on every rank; None if there was nothing to run or a rank failed (the
        engine is dead then)."""
        if self.dead is not None or not (plan.chunks or plan.cache_ops or plan.released):
            return None
        try:
            return self.executor.execute(plan)
        except RankFailure as exc:
            self._die(str(exc))
            return None

    def apply_decided_ops(self) -> None:
        """Apply the data moves the caches decided outside a step plan (cache ops decided in a
        step's update travel with the next plan; see workers/cache/ops.py). With a step in
        flight (async scheduling), after it: the caller may hand pages freed since it was
        submitted (an ended request's, which it still writes) to a transfer."""
        if self._ahead is not None:
            wait([self._ahead[1]])
        cache = self.cache
        self._execute(StepPlan(cache_ops=cache.take_ops(), released=cache.take_released()))

    def _die(self, reason: str) -> None:
        """A rank failed: end every request with the reason; refuse new ones from now on."""
        self.dead = reason
        self._ahead = None
        logger.error("engine stopped: %s", reason)
        for request in list(self.requests.values()):
            if request.status is RequestStatus.HANDED_OFF and self.prefill_port is not None:
                self.prefill_port.release(request.request_id, "engine stopped")
            elif request.status is RequestStatus.RECEIVING and self.decode_port is not None:
                self.decode_port.abort(request.request_id, "engine stopped")
            if request.status is RequestStatus.HANDED_OFF:
                request.finish_reason = "error"  # pinned by a send: freed after it
            else:
                self.scheduler.finish(request, "error")
            request.error = f"the engine stopped: {reason}"
            self._ended.append(request.to_output())
        self.requests.clear()
        self.executor.shutdown()

    def emit(self, request: Request) -> RequestOutput:
        """Deliver `request`'s output with the next step (a request that changed outside a
        step: a completed or failed receive, its forked choices); returns it."""
        output = self._output(request)
        self._ended.append(output)
        return output

    def _output(self, request: Request) -> RequestOutput:
        """The request's output now; a finished request leaves the engine (with its text)."""
        self.requests.setdefault(request.request_id, request)  # a new choice
        output = request.to_output()
        if request.is_finished:
            del self.requests[request.request_id]
            if self.tokenizer is not None:
                output.text = self.tokenizer.decode(output.token_ids)
        return output

    def _take_ended(self) -> list[RequestOutput]:
        ended, self._ended = self._ended, []
        return ended

    def raise_if_dead(self) -> None:
        if self.dead is not None:
            raise RuntimeError(f"the engine stopped and takes no requests: {self.dead}")

    def shutdown(self) -> None:
        """Stop the engine's other ranks (nothing to do at tensor_parallel_size 1)."""
        self.executor.shutdown()
        if self.scheduler.speculator is not None:
            self.scheduler.speculator.proposer.shutdown()

    # ---- disaggregation ---------------------------------------------------------------------

    def _sweep_transfers(self) -> None:
        if self.prefill_port is not None:
            self.prefill_port.expire()
        if self.decode_port is not None:
            self.decode_port.sweep()

    def has_pending_transfers(self) -> bool:
        """Hand-offs holding pages, receives landing, or quarantined pages."""
        return bool(
            (self.prefill_port is not None and self.prefill_port.pending)
            or (self.decode_port is not None and self.decode_port.has_pending)
        )

    def subscribe(self, sink: CacheEventSink) -> None:
        """Deliver this engine's cache events (blocks and snapshots stored / removed) to
        `sink` after every step that produced some."""
        self._sinks.append(sink)

    def publish_cache_events(self) -> None:
        """Deliver the cache events not delivered yet (each step ends with this)."""
        events = self.cache.take_events()
        if events:
            for sink in self._sinks:
                sink.on_cache_events(events)

    def clear_cache(self) -> None:
        """Drop every cached block and snapshot (running requests keep what they hold)."""
        self.cache.clear()
        self.publish_cache_events()

    def check_integrity(self) -> None:
        """The caches' bookkeeping, rank 0's block tables against the coordinator's, and
        every rank against rank 0 (plans executed, pools)."""
        self.cache.check_integrity()
        if self.dead is None:
            if self._ahead is not None:
                wait([self._ahead[1]])  # the ranks' tables are the step's to change until then
            tables = self.executor.driver.block_tables.as_mapping()
            problems = self.cache.attention.rank_table_problems(tables)
            if problems:
                raise RuntimeError("block table check failed: " + "; ".join(problems[:5]))
            self.executor.check_ranks()
