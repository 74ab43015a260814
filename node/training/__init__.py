"""The trainer side: the ranks elastic-launched by the agent, the built-in model and the data they train on."""
