"""Deployed roles: the gRPC server, client and edge processes, the deployment's
config, resuming, and the launcher's tree.
"""
