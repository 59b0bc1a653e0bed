"""Where each route row came from (docs/design.md 5.1): per row, the weight version of the forward
that computed it, how it was obtained, and the agent turn whose engine call sent it.

``source_N`` (uint8): ``NONE`` (0, no forward computed it: the row is MISSING and routed natively),
``COMPUTED`` (1, computed by the forward of the call that sent it), ``PREFIX_HIT`` (2, read from an
engine's prefix cache, with the version of the forward that filled the block), ``REPREFILL`` (3,
computed again after an update or an eviction: the built-in engine's ``inflight_kv=recompute`` row
of the token fed at the re-prefill). ``version_N`` (int32): >= 1, 0 exactly on ``NONE`` rows.
``turn_N`` (int16): the agent turn (1-based) whose engine call sent the row; 0 for a single-turn
rollout and on ``NONE`` rows.

The learner's policy for rows whose version differs from their token's log-prob version
(``routing.stale_rows``) is ``apply_stale_policy``.

Shape suffixes: N rows, B samples, S positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_rl.errors import RouteError
from moe_rl.metrics import Sum

NONE, COMPUTED, PREFIX_HIT, REPREFILL = 0, 1, 2, 3
SOURCE_NAMES = ("none", "computed", "prefix_hit", "reprefill")
STALE_ROWS = ("replay", "native", "drop_sample")  # routing.stale_rows
PROV_BYTES = 7  # per row: int32 version, uint8 source, int16 turn


@dataclass
class Provenance:
    """Per-row provenance of a route record (or of a jagged batch of them): three [N] tensors."""

    version_N: torch.Tensor  # int32
    source_N: torch.Tensor  # uint8
    turn_N: torch.Tensor  # int16

    @classmethod
    def computed(cls, version_N: torch.Tensor, turn: int = 0) -> Provenance:
        n = int(version_N.shape[0])
        return cls(
            version_N.to(torch.int32),
            torch.full((n,), COMPUTED, dtype=torch.uint8, device=version_N.device),
            torch.full((n,), turn, dtype=torch.int16, device=version_N.device),
        )

    @classmethod
    def none(cls, n: int) -> Provenance:
        return cls(
            torch.zeros(n, dtype=torch.int32, device="cpu"),  # route records live on the host
            torch.zeros(n, dtype=torch.uint8, device="cpu"),
            torch.zeros(n, dtype=torch.int16, device="cpu"),
        )

    @property
    def num_rows(self) -> int:
        return int(self.version_N.shape[0])

    @classmethod
    def cat(cls, parts: list[Provenance]) -> Provenance:
        return cls(*(torch.cat([getattr(p, f) for p in parts]) for f in ("version_N", "source_N", "turn_N")))

    def index(self, row_N: torch.Tensor) -> Provenance:
        return Provenance(self.version_N[row_N], self.source_N[row_N], self.turn_N[row_N])

    def slice(self, a: int, b: int) -> Provenance:
        return Provenance(self.version_N[a:b], self.source_N[a:b], self.turn_N[a:b])

    def with_turn(self, turn: int) -> Provenance:
        """These rows as sent by agent turn ``turn`` (``NONE`` rows keep turn 0)."""
        turn_N = torch.where(self.source_N == NONE, 0, turn).to(torch.int16)
        return Provenance(self.version_N, self.source_N, turn_N)

    def split(self, rows: list[int]) -> list[Provenance]:
        parts = zip(*(torch.split(getattr(self, f), rows) for f in ("version_N", "source_N", "turn_N")))
        return [Provenance(*p) for p in parts]

    def cpu(self) -> Provenance:
        """On the host, as route records live (a no-op where it is already there)."""
        return Provenance(self.version_N.cpu(), self.source_N.cpu(), self.turn_N.cpu())

    def tensors(self) -> dict[str, torch.Tensor]:
        """The three tensors under their names in a saved record blob."""
        return {"prov_version": self.version_N, "prov_source": self.source_N, "prov_turn": self.turn_N}

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor]) -> Provenance:
        return cls(t["prov_version"], t["prov_source"], t["prov_turn"])


def check_provenance(
    prov: Provenance, present_N: torch.Tensor, sample_N: torch.Tensor, row_N: torch.Tensor
) -> None:
    """RouteError naming the first bad sample and row: dtypes, lengths (one entry per route row),
    a source outside ``SOURCE_NAMES``, a version < 0, ``NONE`` on a row with ids or not on a MISSING
    row, a version of 0 on a row with ids (or not 0 on a MISSING one), a negative turn.
    ``present_N``: the rows with expert ids (not MISSING)."""
    want = {"version_N": torch.int32, "source_N": torch.uint8, "turn_N": torch.int16}
    for name, dtype in want.items():
        t = getattr(prov, name)
        if t.dtype != dtype or t.dim() != 1:
            raise RouteError(f"route provenance {name}: {t.dtype} {tuple(t.shape)}, expected {dtype} [rows]")
        if t.shape[0] != present_N.shape[0]:
            raise RouteError(
                f"route provenance {name} has {t.shape[0]} entries for {present_N.shape[0]} route rows"
            )
    src_N, ver_N = prov.source_N.long(), prov.version_N.long()
    checks = (
        (
            src_N >= len(SOURCE_NAMES),
            lambda n: f"source {int(src_N[n])} is not one of 0..{len(SOURCE_NAMES) - 1}",
        ),
        (ver_N < 0, lambda n: f"version {int(ver_N[n])} < 0"),
        (prov.turn_N < 0, lambda n: f"turn {int(prov.turn_N[n])} < 0"),
        (
            (src_N == NONE) == present_N,
            lambda n: (
                f"source {SOURCE_NAMES[int(src_N[n])]} on a row "
                + ("with expert ids" if bool(present_N[n]) else "with no ids (MISSING)")
            ),
        ),
        (
            (ver_N == 0) == present_N,
            lambda n: (
                f"version {int(ver_N[n])} on a row "
                + ("with expert ids (versions are >= 1)" if bool(present_N[n]) else "with no ids (must be 0)")
            ),
        ),
    )
    for bad_N, what in checks:
        if bool(bad_N.any()):
            n = int(bad_N.nonzero()[0])
            raise RouteError(f"sample {int(sample_N[n])}, row {int(row_N[n])}: route provenance {what(n)}")


def stale_rows_N(
    prov: Provenance, sample_N: torch.Tensor, row_N: torch.Tensor, version_BS: torch.Tensor
) -> torch.Tensor:
    """bool [N]: rows with ids whose version differs from their token's log-prob version (row t is
    token t's: computed when it was the input), on sampled tokens only (version > 0)."""
    token_v_N = version_BS.to(sample_N.device)[sample_N, row_N].to(torch.int32)
    return (prov.source_N != NONE) & (token_v_N > 0) & (prov.version_N != token_v_N)


def apply_stale_policy(
    ids_NLK: torch.Tensor,
    prov: Provenance | None,
    sample_N: torch.Tensor,
    row_N: torch.Tensor,
    version_BS: torch.Tensor | None,
    policy: str,
    missing: int,
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """``routing.stale_rows`` on the rows ``stale_rows_N`` finds: (the ids to replay, bool [B] samples
    to keep in the loss, metrics). ``replay``: replayed as recorded; ``native``: set MISSING, so
    the learner routes them natively (and ``routing/missing_frac`` counts them); ``drop_sample``:
    the samples holding one leave the loss. Counted as ``routing/version_mismatch_rows`` whatever the
    policy; ``routing/stale_samples_dropped`` counts the dropped samples. Without provenance or
    versions nothing is stale."""
    B = (
        int(version_BS.shape[0])
        if version_BS is not None
        else int(sample_N.max()) + 1
        if sample_N.numel()
        else 0
    )
    keep_B = torch.ones(B, dtype=torch.bool, device="cpu")  # beside the host route records
    if prov is None or version_BS is None:
        return ids_NLK, keep_B, {}
    stale_N = stale_rows_N(prov, sample_N, row_N, version_BS)
    if policy == "native" and bool(stale_N.any()):
        ids_NLK = ids_NLK.clone()
        ids_NLK[stale_N] = missing
    elif policy == "drop_sample":
        keep_B[sample_N[stale_N].unique()] = False
    return (
        ids_NLK,
        keep_B,
        {
            "routing/version_mismatch_rows": Sum(float(stale_N.sum())),
            "routing/stale_samples_dropped": Sum(float((~keep_B).sum())),
        },
    )
