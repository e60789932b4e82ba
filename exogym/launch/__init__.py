"""The launch layer: where this process stands (environment), who starts a run's processes and supervises them
(launchers), and the one signal handler; the backends below it run inside one process."""

from exogym.launch.choose import BACKENDS, choose_launcher
from exogym.launch.environment import Environment, detect_environment
from exogym.launch.launchers import InProcess, Launcher, LocalProcesses, Torchrun
from exogym.launch.signals import RunInterrupted

__all__ = ["BACKENDS", "choose_launcher", "Environment", "detect_environment", "Launcher", "InProcess",
           "LocalProcesses", "Torchrun", "RunInterrupted"]
