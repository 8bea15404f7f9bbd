"""AdamW on bfloat16 parameters, rounded stochastically, a few multi-tensor ops a step.

The update is torchao's ``_AdamW(bf16_stochastic_round=True)`` (``single_param_adam``): each value
computed in float32 from the parameter, its gradient and its two moments (stored in the parameter's
dtype), the parameter rounded stochastically to bfloat16 (away from zero with the probability of the
dropped 16 bits over 2**16, so that small updates survive on average). The moments are rounded the
same way (``moments="stochastic"``, the default), where torchao rounds them to nearest
(``moments="nearest"``): a second moment's change under half a bfloat16 step is then lost at every
step (``(1 - beta2) * g**2`` against ``v``: at beta2 0.999 any change under 1/256 of ``v``), so that
under a steady gradient it stops short of its value and the steps grow, to 1.5x float32 AdamW's
after 2,000 steps of a constant gradient (tested; stochastically rounded, within 2%). float32 and
float64 parameters are updated in their own precision; float16 ones are refused (their moments
underflow, and their updates round to nearest).

torchao calls a compiled function once per parameter per step; here the parameters of one (device,
dtype, step count) are laid end to end in float32 a chunk of :attr:`StochasticAdamW.chunk_numel`
elements at a time, and each chunk is updated by the same 33 ops on element-sized tensors (23 with
``moments="nearest"``) whatever the number of parameters in it: ops dispatched per step grow with the
parameters' size, not their count.

With ``moments="nearest"`` and the same random bits it is bitwise torchao's update run eagerly (on a
CPU, where ``randint`` draws one value per element in order, a chunk draws what torchao's
per-parameter draws do; tested). Under ``torch.compile`` torchao's update draws its bits from
inductor's generator instead; then parameters agree to one bfloat16 step where the draws differ, and
moments bitwise.

Memory: parameters, gradients and moments as with torchao (2 bytes each a bfloat16 parameter, no
float32 master), plus the chunk's temporaries while a step runs: at most 20 bytes an element of the
chunk (four float32 copies and the gradient's square; 80 MiB at the default 2**22), freed after it.

``compile=True`` runs each chunk's arithmetic as one function under ``torch.compile`` (:func:`_fused`: the
four gathered chunks in, the parameter and moments out in their dtype) instead of the elementwise ops: on
a GPU inductor makes it one kernel, reading 8 and writing 6 bytes an element of a bfloat16 chunk where
the ops read and write about 170. The gathering ``cat`` calls and the copies back stay as they are. The
chunk's length is dynamic and the hyperparameters are tensors: one graph per device and dtype, whatever
the chunks' lengths and the betas a schedule sets (a chunk of one element runs the function eagerly).
Its random bits are inductor's: parameters agree with the eager update to one step of their dtype
where the draws differ, and moments to one step (float32: to its rounding).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..torch_private import FakeTensor, foreach_copy_, is_traceable_wrapper_subclass

__all__ = ["StochasticAdamW"]


def _round_stochastically(x: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` to bfloat16, away from zero with the probability of its lower 16 bits over 2**16:
    torchao's ``_fp32_to_bf16_sr`` bit for bit given the same draws (it rounds up where ``rand < low
    bits``, which is where ``low bits + 65535 - rand`` carries into bit 16), in place on one buffer."""
    bits = torch.randint(0, 1 << 16, x.shape, device=x.device, dtype=torch.int32)
    bits.neg_().add_(65535).add_(x.view(torch.int32)).bitwise_and_(-65536)  # 0xFFFF0000
    return _kept_nan(x, bits)


def _kept_nan(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """``bits`` (``x``'s, rounded) as bfloat16, a NaN of ``x`` kept: its bits plus the draw may carry
    into the sign (0x7FFFFFFF, the NaN CUDA's float32 arithmetic makes, came out -0.0: a NaN update
    silently zeroed)."""
    rounded = bits.view(torch.float32)
    return torch.where(x.isnan(), x, rounded, out=rounded).bfloat16()


def _round_moment(x: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` to bfloat16, rounded stochastically as :func:`_round_stochastically` rounds (with
    ``rand`` where torchao's draws take ``65535 - rand``, the same distribution: no torchao update rounds
    its moments so, and two ops fewer)."""
    bits = torch.randint(0, 1 << 16, x.shape, device=x.device, dtype=torch.int32)
    bits.add_(x.view(torch.int32)).bitwise_and_(-65536)
    return _kept_nan(x, bits)


def _fused(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, lr: torch.Tensor,
           correction1: torch.Tensor, root2: torch.Tensor, weight1: torch.Tensor, weight2: torch.Tensor,
           eps: torch.Tensor, stochastic: bool, moments: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk's update, the eager loop's ops in its order on copies of ``p``, ``g``, ``m``, ``v`` (a
    chunk each, in the parameter's dtype) in float32 (float64 for float64): the new parameter (rounded
    stochastically where ``stochastic``, else to nearest) and moments (stochastically where ``moments``),
    in that dtype. The hyperparameters are 0-dim tensors, so that a schedule changing them (OneCycleLR's
    betas) makes no new graph: ``weight1`` and ``weight2`` are ``1 - beta1`` and ``1 - beta2``, taken in
    double precision as the eager ops take them. Run compiled (``compile=True``)."""
    dtype, wide = p.dtype, _compute_dtype(p.dtype)
    p, g, m, v = p.to(wide), g.to(wide), m.to(wide), v.to(wide)
    p = p - p * decay
    m = m.lerp(g, weight1)
    v = v.lerp(g.square(), weight2)
    p = p - (m / correction1 * lr) / (v.sqrt() / root2 + eps)
    if moments:
        m, v = _round_moment(m), _round_moment(v)
    return (_round_stochastically(p) if stochastic else p.to(dtype)), m.to(dtype), v.to(dtype)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """What a parameter of ``dtype`` is updated in: float32, float64 for float64 (kept to its precision)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


_COMPILED: list[Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = []


def _compiled() -> Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """:func:`_fused` under ``torch.compile``, made once for the process: the chunk's length dynamic, so
    one graph per device, dtype and rounding. Not ``fullgraph``: past dynamo's recompile limit (many
    devices and dtypes in one process) it runs the function eagerly instead of failing the step."""
    if not _COMPILED:
        _COMPILED.append(torch.compile(_fused, dynamic=True))
    return _COMPILED[0]


class _Piece:
    """A run of one tensor's elements in a chunk: the whole tensor, or a slice of a contiguous one."""

    __slots__ = ("index", "start", "numel")

    def __init__(self, index: int, start: int, numel: int) -> None:
        self.index, self.start, self.numel = index, start, numel


def _chunks(tensors: list[torch.Tensor], limit: int) -> list[list[_Piece]]:
    """``tensors`` laid end to end and cut every ``limit`` elements (a tensor not contiguous stays whole)."""
    chunks: list[list[_Piece]] = [[]]
    room = limit
    for i, t in enumerate(tensors):
        n, start = t.numel(), 0
        if not t.is_contiguous():
            if room < limit and n > room:
                chunks.append([])
                room = limit
            chunks[-1].append(_Piece(i, 0, n))
            room -= n
            continue
        while n > 0:
            if room <= 0:
                chunks.append([])
                room = limit
            take = min(n, room)
            chunks[-1].append(_Piece(i, start, take))
            start, n, room = start + take, n - take, room - take
    return [c for c in chunks if c]


def _flat(t: torch.Tensor, piece: _Piece) -> torch.Tensor:
    """The piece's elements of ``t`` as a 1-D view (``t`` contiguous) or, not contiguous, ``t`` itself."""
    if not t.is_contiguous():
        return t
    flat = t.view(-1)
    return flat if piece.numel == flat.numel() else flat[piece.start:piece.start + piece.numel]


def _elements(t: torch.Tensor, piece: _Piece) -> torch.Tensor:
    """The piece's elements of ``t`` in order, 1-D (a copy where ``t`` is not contiguous)."""
    flat = t.view(-1) if t.is_contiguous() else t.reshape(-1)
    return flat if piece.numel == flat.numel() else flat[piece.start:piece.start + piece.numel]


class _Chunk:
    """One chunk's pieces: their sizes, and the parameters' and moments' pieces as 1-D views (read by
    ``cat`` and written by ``_foreach_copy_`` in place), a tensor not contiguous as itself."""

    __slots__ = ("numel", "pieces", "sizes", "views", "odd")

    def __init__(self, pieces: list[_Piece], kinds: list[list[torch.Tensor]]) -> None:
        self.pieces, self.sizes = pieces, [piece.numel for piece in pieces]
        self.numel = sum(self.sizes)
        self.views = [[_flat(tensors[piece.index], piece) for piece in pieces] for tensors in kinds]
        #: positions of the pieces that are whole tensors not contiguous (read by reshape, written by shape)
        self.odd = [i for i, v in enumerate(self.views[0]) if not v.is_contiguous() or v.dim() != 1]

    def read(self, views: list[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
        """The views' elements end to end, in ``dtype`` (None: their own)."""
        if self.odd:
            views = [v.reshape(-1) if i in self.odd else v for i, v in enumerate(views)]
        flat = torch.cat(views)  # (one dtype in and out: CUDA's cat batches its inputs only then)
        return flat if dtype is None else flat.to(dtype)

    def gather(self, tensors: list[Any]) -> torch.Tensor:
        """The chunk's elements of ``tensors`` (the gradients, laid out as the parameters), end to end, in their dtype."""
        return torch.cat([_elements(tensors[piece.index], piece) for piece in self.pieces])

    def write(self, views: list[torch.Tensor], flat: torch.Tensor) -> None:
        parts = list(flat.split(self.sizes))
        for i in self.odd:
            parts[i] = parts[i].view(views[i].shape)
        foreach_copy_(views, parts)


class _Plan:
    """The chunks of one run of parameters (and their moments), kept while none of them moved."""

    __slots__ = ("chunks",)

    def __init__(self, params: list[torch.Tensor], m: list[torch.Tensor], v: list[torch.Tensor], limit: int) -> None:
        self.chunks = [_Chunk(pieces, [params, m, v]) for pieces in _chunks(params, limit)]


def _where(t: torch.Tensor) -> int:
    """Where ``t``'s memory is (a fake or meta tensor, which has none: the tensor itself)."""
    return id(t) if t.is_meta or isinstance(t, FakeTensor) else t.data_ptr()


def _key(params: list[torch.Tensor], m: list[torch.Tensor], v: list[torch.Tensor]) -> tuple[Any, ...]:
    """Where each tensor's memory is, and how it lies there (a parameter given new data, even in the same
    memory transposed, a moment loaded: another key)."""
    return tuple((_where(t), t.shape, t.stride()) for tensors in (params, m, v) for t in tensors)


#: torch AdamW's switches this update has no part of: set in a group (added, or loaded from a
#: ``torch.optim.AdamW`` state_dict), each would be ignored
_UNSUPPORTED = ("amsgrad", "maximize", "capturable", "differentiable")
_MOMENTS = ("stochastic", "nearest")


def _refuse_switches(groups: Iterable[dict[str, Any]], where: str) -> None:
    """Refuse groups setting one of torch AdamW's switches this update would ignore (:data:`_UNSUPPORTED`)."""
    for group in groups:
        on = [name for name in _UNSUPPORTED if group.get(name)]
        if on:
            raise ValueError(f"StochasticAdamW.{where}: a parameter group sets {', '.join(on)}=True, which this "
                             "update does not do (it would be ignored); leave it out, or train with "
                             "torch.optim.AdamW on float32 masters, memory_lean(..., master=True)")


class StochasticAdamW(torch.optim.Optimizer):
    """AdamW whose bfloat16 parameters are rounded stochastically after each update, with moments in
    the parameters' dtype (see the module docstring): what ``memory_lean(..., master=False)`` trains.

    ``lr`` may be a float or a tensor, and a scheduler may set it or the betas. ``moments``: how bfloat16
    moments are stored, ``"stochastic"`` (rounded as the parameters are: unbiased, where rounding to
    nearest loses the second moment's small changes, so that a steady gradient's steps grow to 1.5x
    float32 AdamW's over 2,000 steps) or ``"nearest"`` (torchao's update, bitwise). float32 and float64
    parameters are updated in their own precision, exactly rounded; float16 ones are refused (their
    moments underflow). ``compile=True``: each chunk's arithmetic compiled into one function (module
    docstring)."""

    #: what memory_lean(master=False) asks of an optimizer
    bf16_stochastic_round = True

    def __init__(self, params: Iterable[Any], lr: float | torch.Tensor = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, moments: str = "stochastic",
                 chunk_numel: int = 1 << 22, compile: bool = False, **unsupported: Any) -> None:
        if unsupported:
            raise TypeError(f"StochasticAdamW: {', '.join(sorted(unsupported))} not supported (it takes lr, betas, eps, "
                            "weight_decay, moments, chunk_numel, compile); for AdamW's other switches use "
                            "torch.optim.AdamW on float32 masters, memory_lean(..., master=True)")
        lr_value = float(lr)
        for name, value, ok, rule in (("lr", lr_value, lr_value >= 0, ">= 0"), ("eps", eps, eps >= 0, ">= 0"),
                                      ("betas[0]", betas[0], 0 <= betas[0] < 1, "in [0, 1)"),
                                      ("betas[1]", betas[1], 0 <= betas[1] < 1, "in [0, 1)"),
                                      ("weight_decay", weight_decay, weight_decay >= 0, ">= 0"),
                                      ("chunk_numel", chunk_numel, isinstance(chunk_numel, int) and chunk_numel > 0, "a whole number > 0"),
                                      ("moments", moments, moments in _MOMENTS, " or ".join(map(repr, _MOMENTS)))):
            if not ok or (isinstance(value, float) and math.isnan(value)):
                raise ValueError(f"StochasticAdamW: {name} must be {rule}, got {value!r}")
        if not isinstance(compile, bool):
            raise TypeError(f"StochasticAdamW: compile must be True or False, got {compile!r}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})
        self.chunk_numel, self.compile, self.moments = chunk_numel, compile, moments
        #: the views of each run of parameters, by where their memory is; a plan no step used is dropped
        #: (it would hold memory a parameter given new data has left)
        self._plans: dict[tuple[Any, ...], _Plan] = {}
        self._used: set[tuple[Any, ...]] = set()

    def __getstate__(self) -> dict[str, Any]:
        """torch's (defaults, state, groups) and this optimizer's settings; the plans are remade."""
        return {**super().__getstate__(), "chunk_numel": self.chunk_numel, "compile": self.compile, "moments": self.moments}

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = {"chunk_numel": 1 << 22, "compile": False, "moments": "stochastic", **state}
        super().__setstate__(state)
        self._plans, self._used = {}, set()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's, refusing a group that sets a switch this update has no part of (``maximize``...)."""
        _refuse_switches([param_group], "add_param_group")
        super().add_param_group(param_group)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's, refusing, before anything changes, a state whose groups set a switch this update has
        no part of (a ``torch.optim.AdamW(amsgrad=True)``'s: its ``max_exp_avg_sq`` would be dropped)."""
        _refuse_switches(state_dict.get("param_groups", []), "load_state_dict")
        super().load_state_dict(state_dict)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One AdamW update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = [(group, [p for p in group["params"] if p.grad is not None]) for group in self.param_groups]
        _refuse_switches(self.param_groups, "step")  # (one set on a group directly)
        for _, params in groups:  # every group checked before any is updated: a refusal changes nothing
            self._check(params)
        for group, params in groups:
            if not params:
                continue
            states = [self._state(p) for p in params]
            runs: dict[tuple[torch.device, torch.dtype, float], list[int]] = {}
            for i, (p, state) in enumerate(zip(params, states)):
                state["step"] += 1
                runs.setdefault((p.device, p.dtype, state["step"]), []).append(i)
            for (_, dtype, count), members in runs.items():
                wide = _compute_dtype(dtype)  # (the step count and lr in it: torchao's are float32)
                lr = group["lr"]
                lr = lr.detach().to("cpu", wide) if isinstance(lr, torch.Tensor) else torch.tensor(lr, dtype=wide)
                self._update([params[i] for i in members], [states[i] for i in members],
                             torch.tensor(count, dtype=wide), lr, group, dtype)
        if len(self._plans) > len(self._used):
            self._plans = {key: plan for key, plan in self._plans.items() if key in self._used}
        self._used.clear()
        return loss

    def _check(self, params: list[torch.Tensor]) -> None:
        for p in params:
            assert p.grad is not None
            if p.grad.is_sparse:
                raise RuntimeError("StochasticAdamW: sparse gradients are not supported (nn.Embedding(sparse=True)); "
                                   "use a dense embedding, or torch.optim.SparseAdam for that parameter")
            if p.dtype == torch.float16:
                raise TypeError(f"StochasticAdamW: a float16 parameter {tuple(p.shape)}: its moments would underflow "
                                "in float16 (a gradient of 1e-4 squares to 0) and its updates round to nearest, "
                                "losing the small ones; train it in bfloat16 (memory_lean(weights=torch.bfloat16, "
                                "master=False)), or in float16 with float32 masters (memory_lean(weights=torch.float16))")
            if not p.is_floating_point() or p.grad.dtype != p.dtype or p.grad.shape != p.shape:
                raise TypeError(f"StochasticAdamW: a parameter of {p.dtype} {tuple(p.shape)} has a gradient of "
                                f"{p.grad.dtype} {tuple(p.grad.shape)}; it takes floating-point parameters with "
                                "gradients of their own dtype and shape")
            if is_traceable_wrapper_subclass(p):
                raise TypeError(f"StochasticAdamW: parameters of type {type(p).__name__} (a tensor subclass: DTensor, "
                                "a quantized weight) are not supported; use torchao's optimizers for those")

    def _state(self, p: torch.Tensor) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            state["step"] = 0.0  # a number on the host (torch's AdamW kept one before 1.12): read without a sync
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        elif isinstance(state["step"], torch.Tensor):  # a state_dict whose steps are tensors (torchao's, torch's)
            state["step"] = float(state["step"])
        return state

    def _update(self, params: list[torch.Tensor], states: list[dict[str, Any]], step: torch.Tensor, lr: torch.Tensor,
                group: dict[str, Any], dtype: torch.dtype) -> None:
        """Update ``params`` (one device, dtype and step count) a chunk at a time, each chunk in float32
        (float64 parameters in float64)."""
        beta1, beta2 = group["betas"]
        stochastic = dtype == torch.bfloat16
        moments = stochastic and self.moments == "stochastic"
        wide = _compute_dtype(dtype)
        decay = lr * group["weight_decay"]
        correction1, correction2 = 1 - beta1 ** step, 1 - beta2 ** step
        root2 = correction2.sqrt()
        m_all = [s["exp_avg"] for s in states]
        v_all = [s["exp_avg_sq"] for s in states]
        key = _key(params, m_all, v_all)
        plan = self._plans.get(key)
        if plan is None:
            for p, state in zip(params, states):  # moments in their parameter's layout (a state loaded in another)
                for name in ("exp_avg", "exp_avg_sq"):
                    if state[name].stride() != p.stride() or state[name].dtype != p.dtype:
                        state[name] = torch.empty_like(p).copy_(state[name])
            m_all, v_all = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
            key = _key(params, m_all, v_all)
            plan = self._plans[key] = _Plan(params, m_all, v_all, self.chunk_numel)
        self._used.add(key)
        grads = [p.grad for p in params]
        if self.compile:
            compiled = _compiled()
            weight1, weight2, eps = (torch.tensor(x, dtype=wide) for x in (1 - beta1, 1 - beta2, group["eps"]))
            for chunk in plan.chunks:
                p_views, m_views, v_views = chunk.views
                g = chunk.gather(grads)
                fused = compiled if chunk.numel > 1 else _fused  # (dynamo specialises a length of one: no graph for it)
                new = fused(chunk.read(p_views), g, chunk.read(m_views), chunk.read(v_views),
                            decay, lr, correction1, root2, weight1, weight2, eps, stochastic, moments)
                del g
                for views, value in zip(chunk.views, new):
                    chunk.write(views, value)
            return
        for chunk in plan.chunks:
            p_views, m_views, v_views = chunk.views
            g = chunk.gather(grads).to(wide)
            p, m, v = chunk.read(p_views, wide), chunk.read(m_views, wide), chunk.read(v_views, wide)
            p.sub_(p * decay)
            m.lerp_(g, 1 - beta1)
            v.lerp_(g.square(), 1 - beta2)
            del g
            chunk.write(m_views, _round_moment(m) if moments else m)
            chunk.write(v_views, _round_moment(v) if moments else v)
            denom = v.sqrt_().div_(root2).add_(group["eps"])
            p.sub_(m.div_(correction1).mul_(lr).div_(denom))
            del m, v, denom
            chunk.write(p_views, _round_stochastically(p) if stochastic else p)
            del p  # before the next chunk's copies are made: one chunk's temporaries at a time
