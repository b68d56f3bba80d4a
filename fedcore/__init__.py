"""fedcore: an event-driven, message-passing federated-learning runtime.

Workers (one server, many clients) register `<event, handler>` pairs on a
discrete-event scheduler; trainers and aggregators plug in by name.
"""
__version__ = "0.1.0"
