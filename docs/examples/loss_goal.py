"""Finish a course early once the sampled clients report a low enough training loss.

A worked example of extending a course without touching its default handlers'
code: a new message type (`progress`, client -> server) and a new condition
event (`loss_goal_reached`, on the server), installed as an extension. The
tutorial docs/tutorial_custom_handler.md is this file, step by step.
"""
from fedcore.kernel.config import declare
from fedcore.handlers.rounds import finish_course
from fedcore.kernel.message import SERVER_ID
from fedcore.kernel.registry import behaviours
from fedcore.kernel.schema import clients_per_round
from fedcore.kernel.worker import Stopwatch

declare("loss_goal.threshold", float, 0.5,
        "finish once a round's mean reported training loss is below this")


def train_and_report(client, msg):
    """Client `receiving_models`: train and reply as usual, then report the training loss."""
    client.round = msg.round
    with Stopwatch() as sw:
        result = client.course.trainer.fit(client.id, client.data, msg.content, msg.round)
    client.spend(result.work, sw.seconds)
    client.send("updates", SERVER_ID, result.content, round_=msg.round,
                content_size=result.content_size)
    client.send("progress", SERVER_ID, {"train_loss": result.metrics.get("train_loss", 0.0)},
                round_=msg.round)


def collect_progress(server, msg):
    """Server `receiving_progress`: once a round's reports are all in, check the goal."""
    reports = server.loss_reports.setdefault(msg.round, [])
    reports.append(msg.content["train_loss"])
    if len(reports) == clients_per_round(server.course.cfg):
        mean = sum(reports) / len(reports)
        if mean < server.course.cfg["loss_goal.threshold"] and not server.finished:
            server.trigger("loss_goal_reached", {"round": msg.round, "mean_loss": mean})


def finish_early(server, event):
    """Server `loss_goal_reached`: record why and which model the run ends with, then finish."""
    event["last_aggregated_round"] = server.round - 1
    server.course.monitor.add_summary("loss_goal", {"loss_goal": event})
    finish_course(server, event)


@behaviours.register("loss_goal")
def install(course):
    course.server.loss_reports = {}
    course.client_table.register("receiving_models", train_and_report, sends=("updates", "progress"))
    course.server_table.register("receiving_progress", collect_progress, sends=("loss_goal_reached",))
    course.server_table.register("loss_goal_reached", finish_early, sends=("finish",))
