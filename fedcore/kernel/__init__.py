"""The kernel: messages, workers, the discrete-event scheduler, the completeness check,
the registry, the plug-in contract and its hooks, the config and its schema, typed
state. It imports no executor, course machinery, communicator or deployed role.
"""
