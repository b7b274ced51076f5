"""`nitsum sim <name>` experiments: tiers (Nitsum), mixes (which phase mixes separate the layouts), flows (Nuska),
reconfig, estimates (the adaptive estimator's ranking of static layouts against their simulated goodput). Each
writes CSV, PNG and Markdown."""

EXPERIMENTS: dict[str, str] = {
    "tiers": "nitsum.sim.experiments.tiers",
    "mixes": "nitsum.sim.experiments.mixes",
    "flows": "nitsum.sim.experiments.flows",
    "reconfig": "nitsum.sim.experiments.reconfig",
    "estimates": "nitsum.sim.experiments.estimates",
}
