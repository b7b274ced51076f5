"""`nitsum sim <name>` experiments: tiers (Nitsum), flows (Nuska), reconfig. Each writes CSV, PNG and Markdown."""

EXPERIMENTS: dict[str, str] = {
    "tiers": "nitsum.sim.experiments.tiers",
    "flows": "nitsum.sim.experiments.flows",
    "reconfig": "nitsum.sim.experiments.reconfig",
}
