"""farloco.node: the agent daemon, trainer ranks, model, data, config and CLI."""
