"""Strategies: what each node does at every step, and what it communicates."""

from exogym.strategy.optim import OptimSpec
from exogym.strategy.base import Strategy
from exogym.strategy.server_strategy import ServerStrategy
from exogym.strategy.ddp import SimpleReduceStrategy
from exogym.strategy.communicate_optimize_strategy import CommunicateOptimizeStrategy, CommunicationModule
from exogym.strategy.diloco import DiLoCoCommunicator, DiLoCoStrategy
from exogym.strategy.sparta import SparseCommunicator, SPARTAStrategy, TopKSparseCommunicator
from exogym.strategy.federated_averaging import AveragingCommunicator, FedAvgStrategy
from exogym.strategy.sparta_diloco import SPARTADiLoCoStrategy
from exogym.strategy.demo import DeMo, DeMoStrategy
from exogym.strategy.dgc import DGCStrategy
from exogym.strategy.streaming_diloco import StreamingDiLoCoCommunicator, StreamingDiLoCoStrategy
from exogym.strategy.async_diloco import AsyncDiLoCoStrategy
from exogym.strategy.fedbuff import FedBuffStrategy
from exogym.strategy.decoupled_diloco import DecoupledDiLoCoStrategy
from exogym.strategy.gossip import GossipStrategy
from exogym.strategy.server_rounds import ServerRoundsStrategy

__all__ = ["Strategy", "ServerStrategy", "SimpleReduceStrategy", "OptimSpec",
           "CommunicateOptimizeStrategy", "CommunicationModule", "AveragingCommunicator", "SparseCommunicator",
           "DiLoCoCommunicator", "DiLoCoStrategy", "FedAvgStrategy", "SPARTAStrategy", "SPARTADiLoCoStrategy",
           "DeMo", "DeMoStrategy", "DGCStrategy", "TopKSparseCommunicator", "StreamingDiLoCoCommunicator",
           "StreamingDiLoCoStrategy", "AsyncDiLoCoStrategy", "FedBuffStrategy", "DecoupledDiLoCoStrategy", "GossipStrategy",
           "ServerRoundsStrategy"]
