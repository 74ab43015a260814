"""The daemon: the agent process of a node (its rounds, joining and catching up, the ranks it supervises,
checkpoints, the control server and metrics) and its DHT child."""
