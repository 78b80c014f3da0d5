"""What an update mode is: both sides of the update protocol, and the configs it accepts.

A mode (``mode=sync|async|ssp|hybrid``) decides

- on a server: when a read of its parameters (a forward, a lookup of table rows) may run
  and on which copy of them (``forward``, ``lookup``); how a trainer's gradients become
  optimizer steps (``update``); whether trainers wait for each other between steps
  (``clock``); what it counts (``stats``) and saves in a checkpoint (``state_dict``);
- on a trainer: which update it asks every server for (``send_update``), what it learns when
  the update is in (``settled``: staleness, steps ahead), whether it may send the next
  forward before that (``pipelined``), and what it logs (``train_scalars``);
- before anything starts: which options and which setups it accepts (``option_problems``,
  ``run_problems``, ``not_elastic``).

Every process builds one mode object from the config (``ps_train.modes.make_mode``); a server
uses its server side, a trainer its trainer side. The mode sees the server, the trainer and
the config through the small interfaces below, so it imports nothing else of ps_train (the
config imports the registry, ``ps_train.modes``, to check a mode's options).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, NamedTuple, Protocol

import torch
from torch import Tensor

__all__ = [
    "Mode",
    "ModeOptions",
    "RunConfig",
    "ModeServer",
    "ModeTrainer",
    "TrainerMembership",
    "PositionRecord",
    "UpdateRequest",
    "UPDATE_IN_BACKWARD",
    "resolved",
]

# The key of the update that rides on the backward (rpc_core.autograd.hooks, backend=rpc_core).
UPDATE_IN_BACKWARD = "ps_train.update"


class UpdateRequest(NamedTuple):
    """What a trainer's backward tells every server about the update it carries."""

    trainer: int
    step: int
    # async/ssp and elastic: the trainer's data position after this step (every server notes it)
    position: dict[str, int] | None


# -- what a mode reads of the config (ps_train.config.Config and its groups) ------------------------
class ModeOptions(Protocol):
    """The ``mode`` group (``ps_train.config.ModeConfig``)."""

    @property
    def name(self) -> str: ...

    @property
    def staleness(self) -> int: ...

    @property
    def aggregate(self) -> str: ...

    @property
    def staleness_rule(self) -> str: ...


class ClusterShape(Protocol):
    """The ``cluster`` group (``ps_train.config.ClusterConfig``)."""

    @property
    def num_servers(self) -> int: ...

    @property
    def num_trainers(self) -> int: ...

    @property
    def num_worker_threads(self) -> int: ...

    @property
    def placement(self) -> str: ...

    @property
    def elastic(self) -> bool: ...


class ModelFacts(Protocol):
    """The ``model`` group (``ps_train.config.ModelConfig``)."""

    @property
    def name(self) -> str: ...

    def num_stages(self) -> int: ...

    def has_batch_norm(self) -> bool: ...

    def needs_ctr_data(self) -> bool:
        """Whether it has embedding tables besides its dense stages (model=dlrm)."""


class RunConfig(Protocol):
    """A run's config (``ps_train.config.Config``)."""

    @property
    def mode(self) -> ModeOptions: ...

    @property
    def cluster(self) -> ClusterShape: ...

    @property
    def model(self) -> ModelFacts: ...

    @property
    def backend(self) -> str: ...


# -- what a mode uses of the roles ----------------------------------------------------------------
class TrainerMembership(Protocol):
    """ps0's record of who trains in an elastic run (``ps_train.elastic.membership.Membership``)."""

    def counted(self) -> set[int]: ...


class PositionRecord(Protocol):
    """A server's record of each trainer's data position after its last update applied there
    (``ps_train.checkpoint.positions.TrainerPositions``)."""

    def completed(self, trainer: int, step: int, position: dict[str, int]) -> None: ...


class ModeServer(Protocol):
    """A parameter server (``ps_train.roles.server.ParameterServer``)."""

    @property
    def rank(self) -> int: ...

    @property
    def lock(self) -> threading.Lock:
        """Held while the parameters change, and to read them whole."""

    @property
    def version(self) -> int:
        """Updates applied so far (every shard here steps with every update)."""

    @property
    def has_running_stats(self) -> bool:
        """Whether a forward here updates BatchNorm running statistics in place."""

    @property
    def membership(self) -> TrainerMembership | None:
        """ps0 of an elastic run: who trains; else None."""

    @property
    def positions(self) -> PositionRecord:
        """Each trainer's data position after its last update applied here; the mode notes
        it with the update, under ``lock``."""

    @property
    def dense_params(self) -> Sequence[Tensor]:
        """Its shards' parameters; the others are a model's embedding tables (a mode that
        treats the two differently splits gradients by it)."""

    @property
    def owns_gradients(self) -> bool:
        """Whether the tensors ``gradients`` returns are the caller's alone (the autograd
        context handed them over): a mode may then change them in place."""

    def gradients(self, context_id: int) -> dict[Tensor, Tensor]:
        """This server's parameters' gradients in a trainer's autograd context."""

    def step(self, grads: Mapping[Tensor, Tensor], lr_factor: float = 1.0) -> None:
        """One optimizer step with ``grads`` at ``lr_factor`` times the configured rates;
        the caller holds ``lock``."""

    def run_shard(self, shard: int, x: Tensor, trainer: int, step: int) -> Tensor:
        """``shard``'s forward on the live parameters (dropout seeded by trainer and step)."""

    def shard_copy(self, shard: int) -> dict[str, Tensor]:
        """Private copies of ``shard``'s parameters (differentiable); the caller holds ``lock``."""

    def run_shard_with(self, shard: int, params: dict[str, Tensor], x: Tensor) -> Tensor:
        """``shard``'s forward on ``params`` (from ``shard_copy``)."""

    def after_answer(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` once the answer of the request being served here is written
        (``ps_train.backend.after_response``)."""


class ModeTrainer(Protocol):
    """A trainer (``ps_train.roles.trainer.Trainer``)."""

    @property
    def index(self) -> int: ...

    @property
    def servers(self) -> Sequence[Any]:
        """RRefs to the ParameterServers, ps0 first."""


def resolved(value: Any) -> torch.futures.Future[Any]:
    """A future that already holds ``value`` (an answer that did not have to wait)."""
    fut: torch.futures.Future[Any] = torch.futures.Future()
    fut.set_result(value)
    return fut


class Mode(ABC):
    """One update mode: subclass, set the class attributes, implement the server side
    (``forward``, ``lookup``, ``update``) and ``settled``; register it in ``ps_train.modes``
    and add ``ps_train/conf/mode/<name>.yaml``."""

    name: ClassVar[str]
    # The mode.* options it reads besides name; every other one must keep its default.
    options: ClassVar[tuple[str, ...]] = ()
    # Why an option it does not read would do nothing here (the end of that error), by option.
    unused_reasons: ClassVar[dict[str, str]] = {}
    # Why it cannot run with cluster.elastic=true (trainers that come and go); None: it can.
    not_elastic: ClassVar[str | None] = None
    # Trainer side: whether a trainer sends its next forward before its update is answered.
    pipelined = False
    # Whether ``in_backward`` answers before the update is applied (it is applied once the
    # answer is written): the trainer then knows it is applied from the order of its next
    # step's reads, or asks ``applied`` where it must know (to log, evaluate, checkpoint).
    applies_after_answer: ClassVar[bool] = False
    # Whether a checkpoint resumes each trainer from its own data position, as the servers
    # noted it with its updates (async, ssp: trainers move apart); False: every trainer is at
    # trainer0's step when trainer0 checkpoints (sync, whose rounds need every trainer).
    per_trainer_positions: ClassVar[bool] = False
    # Server side: whether an update's answer carries the update's staleness (read it with
    # ``answer_staleness``), which the server counts for its metrics.
    answers_with_staleness: ClassVar[bool] = False

    def __init__(self, run: RunConfig) -> None:
        self.num_trainers = run.cluster.num_trainers

    # -- the configs it accepts -----------------------------------------------------------------
    @classmethod
    def option_problems(cls, options: ModeOptions) -> list[str]:
        """Problems with the values of the options it reads."""
        return []

    @classmethod
    def run_problems(cls, run: RunConfig) -> list[str]:
        """Problems of this mode with the other groups (called once model, data and cluster
        are known to fit each other)."""
        return []

    # -- server side ----------------------------------------------------------------------------
    @abstractmethod
    def forward(self, server: ModeServer, shard: int, x: Tensor, trainer: int, step: int) -> Tensor:
        """Trainer ``trainer``'s step-``step`` forward of ``shard`` (step -1: outside a step)."""
        raise NotImplementedError

    @abstractmethod
    def lookup(self, server: ModeServer, rows: Callable[[], Tensor], trainer: int, step: int) -> Tensor:
        """Trainer ``trainer``'s step-``step`` lookup of table rows: ``rows()`` reads them ([P, dim])."""
        raise NotImplementedError

    def in_backward(self, server: ModeServer, context_id: int, request: UpdateRequest) -> torch.futures.Future[Any]:
        """The update that rides on the trainer's distributed backward (backend=rpc_core): run
        on the server once the context's gradients are all there; the future's value comes
        back with the backward (``settled`` gets it). Every mode's ``update`` already takes the
        gradients by context; sync's answers once the round is applied."""
        return self.update(server, context_id, request.trainer, request.step, request.position)

    def applied(self, server: ModeServer, step: int) -> torch.futures.Future[Any]:
        """Resolves to the server's version once the step-``step`` update is applied here;
        at once for a mode whose updates are applied before they are answered."""
        return resolved(server.version)

    @abstractmethod
    def update(
        self, server: ModeServer, context_id: int, trainer: int, step: int, position: dict[str, int] | None
    ) -> torch.futures.Future[Any]:
        """Trainer ``trainer``'s step-``step`` gradients (in its autograd context
        ``context_id``); the future's value goes back to the trainer (``settled``).
        ``position`` (async/ssp, elastic): the trainer's data position after this step."""
        raise NotImplementedError

    def answer_staleness(self, answer: Any) -> int:
        """The staleness an update's answer (the value of ``update``'s or ``in_backward``'s
        future) carries, for a mode that ``answers_with_staleness``."""
        raise RuntimeError(f"mode={self.name}'s update answers carry no staleness")

    def clock(self, server: ModeServer, trainer: int, completed: int) -> torch.futures.Future[Any]:
        """Resolves once trainer ``trainer``, having completed ``completed`` steps, may go on."""
        raise RuntimeError(f"mode={self.name} keeps no clock: its trainers never wait for each other between steps")

    def hold_updates(self, server: ModeServer) -> None:
        """Until ``release_updates``: apply no update here (a checkpoint takes every server's
        state while none of them moves on; ``ParameterServer.begin_save``)."""
        return  # sync: nothing moves while trainer0 checkpoints (its gradients complete every round)

    def release_updates(self, server: ModeServer) -> None:
        """Apply the updates held since ``hold_updates``, in arrival order, and go on."""
        return

    def trainer_finished(self, server: ModeServer, trainer: int) -> None:
        """Trainer ``trainer`` ran its last step."""
        return  # by default nothing to do

    def trainer_changed(self, server: ModeServer, trainer: int, joined: bool) -> None:
        """Elastic, on ps0: trainer ``trainer`` joined or left the job."""
        return  # by default nothing to do

    def stats(self) -> dict[str, Any]:
        """This server's update statistics, for ``ParameterServer.stats``."""
        return {"updates_by_trainer": {}, "max_staleness": 0}

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of this server's side (merged into the server's state)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any], version: int) -> None:
        """Back from ``state`` (a server's saved state; ``version``: its update count)."""
        return  # by default nothing to do

    # -- trainer side ---------------------------------------------------------------------------
    def send_update(
        self, trainer: ModeTrainer, context_id: int, step: int, position: dict[str, int] | None
    ) -> list[torch.futures.Future[Any]]:
        """Ask every server to apply this step's gradients (``position``: the trainer's data
        position after the step, which every server notes)."""
        return [server.rpc_async().update(context_id, trainer.index, step, position) for server in trainer.servers]

    @abstractmethod
    def settled(self, trainer: ModeTrainer, results: list[Any], step: int) -> dict[str, float]:
        """Every server applied step ``step``'s update (``results``: the answers, in server
        order); the step's update metrics. May wait (ssp's clock)."""
        raise NotImplementedError

    def trainer_done(self, trainer: ModeTrainer) -> None:
        """This trainer ran its last step."""
        return  # by default nothing to do

    def train_scalars(self, last: Mapping[str, float], lr: float) -> dict[str, float]:
        """TensorBoard scalars of a logged step (``last``: its metrics; ``lr``: optim.lr)."""
        return {"train/lr": lr}
