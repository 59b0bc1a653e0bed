"""The pure maths of the algorithm: log-ratios and KL estimators (``ratios``), policy losses
(``losses``), advantage estimators (``advantages``), variance diagnostics (``variance``), the
length-aware LR schedule (``lr``), and the torch-free specs of the advantage and the policy loss
(``specs``). Tensors in, tensors and metrics out; no collectives, no config objects."""
