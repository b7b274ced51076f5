"""`nitsum sim <name>` experiments: tiers (Nitsum), mixes (which phase mixes separate layouts), flows (Nuska), reconfig. Each writes CSV, PNG and Markdown."""

EXPERIMENTS: dict[str, str] = {
    "tiers": "nitsum.sim.experiments.tiers",
    "mixes": "nitsum.sim.experiments.mixes",
    "flows": "nitsum.sim.experiments.flows",
    "reconfig": "nitsum.sim.experiments.reconfig",
}
