"""farloco.protocol: wire format, gRPC services, DHT membership, matchmaking, exchange and state transfer.

No model code lives here, and nothing here imports farloco.optim or farloco.node.
"""
