"""The serverless (expert-parallel) replica policies of MoEless §6, one module each: static EP (Megatron-LM),
EPLB, the Oracle and MoEless (with its Expert Scaler and Expert Placer).

Every policy module registers its policy in `schedulers.ep_placement.SERVERLESS` with a frozen settings
dataclass it owns (and its replica slots per device); the registry imports every module here on first
lookup, so a new policy is a module here plus its `conf/serverless/policy/<name>.yaml`. The contract they
implement is `schedulers.ep_placement`.
"""
