"""An asynchronous strategy of your own, with the point-to-point primitives: elastic averaging through a server.

    python examples/async_custom_strategy.py

Every H steps a node sends its parameters to the server, which pulls the global model towards them
(theta <- theta + alpha (x - theta), asynchronous EASGD's server step) and sends theta back; the node moves
halfway to it. A ServerStrategy: the model fit returns is the server's, validation rows carry the server's
updates (`exogym plot --x updates`). docs/asynchronous.md shows this file from its imports on;
tests/asynchrony/test_custom_strategy.py runs it.
"""

# --8<-- [start:custom]
import torch

from exogym.comm import SERVER, Server, recv, send
from exogym.strategy import OptimSpec, ServerStrategy


class ElasticServer(Server):
    def __init__(self, theta: torch.Tensor, alpha: float):
        super().__init__()
        self.theta, self.alpha = theta.clone(), alpha    # the global model, flat: what fit returns

    def receive(self, message):                          # in arrival order, at the arrival time
        self.theta += self.alpha * (message.tensor - self.theta)
        self.record_update(node=message.src, staleness=0, weight=self.alpha)
        self.send(message.src, self.theta)

    def state_dict(self):                                # checkpoints, and reads from another process
        return {"theta": self.theta.clone()}

    def load_state_dict(self, state):
        self.theta.copy_(state["theta"])


class AsyncElasticAveraging(ServerStrategy):
    def __init__(self, H: int = 10, alpha: float = 0.5, **kwargs):
        super().__init__(optim_spec=OptimSpec(torch.optim.SGD, lr=0.05), **kwargs)
        self.H, self.alpha = H, alpha

    def make_server(self, theta, num_nodes):             # once, where the server runs
        return ElasticServer(theta, self.alpha)

    def step(self):
        self.optim.step()
        if (self.local_step + 1) % self.H == 0:
            x = torch.nn.utils.parameters_to_vector(self.model.parameters()).detach()
            send(x, SERVER)                              # leaves at this node's clock
            theta = recv(src=SERVER).tensor              # arrives after the round trip
            torch.nn.utils.vector_to_parameters((x + theta) / 2, self.model.parameters())
        super().step()


if __name__ == "__main__":
    from torch.utils.data import TensorDataset

    from exogym import Trainer
    from exogym.models import MLPClassifier

    torch.manual_seed(0)
    x, w = torch.randn(2048, 20), torch.randn(20, 4)
    data = TensorDataset(x, (x @ w).argmax(1))
    trainer = Trainer(MLPClassifier(20, 4), data, data)
    trainer.fit(AsyncElasticAveraging(H=10), 4, max_steps=100, batch_size=32, node_speeds=[1.0, 0.8, 0.5, 0.25],
                network="home", val_size=256, logger=False)
    print(len(trainer.record.updates), "updates; final validation loss", trainer.record.val[-1]["global_loss"])
# --8<-- [end:custom]
