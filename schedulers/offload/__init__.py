"""The offload policies (LayerScope's PreSched and the baselines), one module each.

Every module of this package registers its policy in `schedulers.base.OFFLOAD` with a frozen settings
dataclass it owns; the registry imports them all on first lookup, so a new policy is a module here plus
its `conf/scheduler/<name>.yaml`. The contract they implement is `schedulers.base`, the shared cache
`schedulers.policy.OffloadPolicy`.
"""
