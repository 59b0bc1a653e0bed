"""Health alarms (issue 14): conditions under which a run goes on but has stopped learning.

A policy whose entropy sits at ln(V) (uniform: e.g. ``optim.lr=1e3`` blew the logits flat) or
near 0 (collapsed onto one token), or whose gradient norm is exactly 0 in every minibatch, for
``log.health.patience`` consecutive steps, raises one warning event. The event goes where the LR
events go: ``events.jsonl`` (``MetricsWriter.log_events``), the rank-0 log, and the report's event
list. The alarm re-arms once its condition clears. Plain Python over the step's reduced metrics:
no torch.distributed.

The route verifier's alarm (``route_verify``, ``routing.verify.alarm_frac``; docs/agentic.md 9) has
no patience: it is checked on the steps the verifier ran, and each one whose
``routing/verify_mismatch_frac`` exceeds the threshold raises one event naming the layer and the
turn with the worst mismatch fraction.
"""

from __future__ import annotations

import logging
import math

from moe_rl.config import HealthConfig

log = logging.getLogger(__name__)


class HealthMonitor:
    """Counts consecutive steps per condition; ``observe`` returns the events of this step."""

    def __init__(
        self, cfg: HealthConfig, vocab_size: int, active: bool = True, verify_alarm_frac: float | None = None
    ) -> None:
        """``active``: the rank that reports (rank 0; the metrics are the same on every rank);
        ``verify_alarm_frac``: ``routing.verify.alarm_frac`` (None: no verifier alarm)."""
        self.cfg, self.active, self.verify_alarm_frac = cfg, active, verify_alarm_frac
        self.uniform = math.log(vocab_size)
        self.count: dict[str, int] = {}

    def _conditions(self, metrics: dict[str, float]) -> dict[str, str | None]:
        """alarm name -> why it holds at this step, or None."""
        c, out = self.cfg, {}
        h = metrics.get("train/entropy")
        bound = c.entropy_uniform_frac * self.uniform
        out["entropy_uniform"] = (
            None
            if h is None or not h >= bound
            else (
                f"policy entropy {h:.4g} nats >= {c.entropy_uniform_frac:g} "
                f"ln(V={round(math.exp(self.uniform))}) "
                f"= {bound:.4g}: the policy is uniform"
            )
        )
        out["entropy_zero"] = (
            None
            if h is None or not h <= c.entropy_zero
            else (f"policy entropy {h:.4g} nats <= {c.entropy_zero:g}: the policy collapsed onto one token")
        )
        g = metrics.get("train/grad_norm_max")
        out["grad_norm_zero"] = (
            None
            if g is None or g != 0
            else ("gradient norm exactly 0 in every minibatch (optimizer steps skipped): nothing is learned")
        )
        return out

    def observe(self, step: int, metrics: dict[str, float]) -> list[dict]:
        if not (self.cfg.enabled and self.active):
            return []
        events = []
        for name, why in self._conditions(metrics).items():
            self.count[name] = self.count.get(name, 0) + 1 if why else 0
            if self.count[name] == self.cfg.patience:
                n = self.cfg.patience
                event = {
                    "step": step,
                    "event": "health",
                    "alarm": name,
                    "severity": "warning",
                    "cause": f"{why} for {n} consecutive step{'s' if n > 1 else ''} "
                    f"(steps {step - n + 1}-{step}; log.health)",
                }
                log.warning("health alarm at step %d: %s", step, event["cause"])
                events.append(event)
        verify = self._verify_event(step, metrics)
        if verify is not None:
            log.warning("health alarm at step %d: %s", step, verify["cause"])
            events.append(verify)
        return events

    def _verify_event(self, step: int, metrics: dict[str, float]) -> dict | None:
        """The route verifier's alarm of this step, or None (no verify ran, or under the threshold)."""
        frac, limit = metrics.get("routing/verify_mismatch_frac"), self.verify_alarm_frac
        if limit is None or frac is None or not frac > limit:  # NaN (nothing compared): silent
            return None

        def worst(kind: str) -> str:
            prefix = f"routing/verify_mismatch_frac/{kind}"
            vals = {k[len(prefix) :]: v for k, v in metrics.items() if k.startswith(prefix) and v == v}
            k = max(vals, key=vals.get) if vals else "?"
            return f"{kind} {k} ({vals.get(k, float('nan')):.4g})"

        return {
            "step": step,
            "event": "health",
            "alarm": "route_verify",
            "severity": "warning",
            "cause": f"stitched routes differ from one full prefill on {frac:.4g} of the compared "
            f"(row, layer) pairs > {limit:g} (routing.verify.alarm_frac); worst {worst('layer')}, "
            f"worst {worst('turn')}",
        }
