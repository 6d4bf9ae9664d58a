"""A GAN trained the way pytorch/examples' dcgan/main.py does it, with small MLPs on CPU:
two wrapped models at once (``DDP(netG)``, ``DDP(netD)``), two Adam optimizers, a
discriminator step (real and fake backward separately) then a generator step whose backward
runs through the discriminator. The only line a port changes is the import.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from porting_kit import result
from torch import nn, optim

if os.environ.get("DDP_IMPL") == "commd":
    from commd_client.torch import DistributedDataParallel as DDP
else:
    from torch.nn.parallel import DistributedDataParallel as DDP

NZ = 4  # size of the latent vector
FEATURES = 8
BATCH = 8


class Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Sequential(nn.Linear(NZ, 16), nn.ReLU(True), nn.Linear(16, FEATURES),
                                  nn.Tanh())

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.main(z)


class Discriminator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Sequential(nn.Linear(FEATURES, 16), nn.LeakyReLU(0.2, inplace=True),
                                  nn.Linear(16, 1), nn.Sigmoid())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.main(x)


def train(rank: int, world_size: int, workdir: str, seed: int) -> dict[str, Any]:
    torch.manual_seed(100 + rank)
    generator, discriminator = Generator(), Discriminator()
    netG = DDP(generator)
    netD = DDP(discriminator)
    criterion = nn.BCELoss()
    real_label, fake_label = 1.0, 0.0
    optimizerD = optim.Adam(netD.parameters(), lr=2e-3, betas=(0.5, 0.999))
    optimizerG = optim.Adam(netG.parameters(), lr=2e-3, betas=(0.5, 0.999))
    data = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(4):
        # (1) Update D network: maximize log(D(x)) + log(1 - D(G(z)))
        netD.zero_grad()
        real = 0.5 * torch.randn(BATCH, FEATURES, generator=data) + 1.0
        label = torch.full((BATCH,), real_label)
        output = netD(real).view(-1)
        errD_real = criterion(output, label)
        errD_real.backward()
        noise = torch.randn(BATCH, NZ, generator=data)
        fake = netG(noise)
        label.fill_(fake_label)
        output = netD(fake.detach()).view(-1)
        errD_fake = criterion(output, label)
        errD_fake.backward()
        optimizerD.step()
        # (2) Update G network: maximize log(D(G(z)))
        netG.zero_grad()
        label.fill_(real_label)  # fake labels are real for generator cost
        output = netD(fake).view(-1)
        errG = criterion(output, label)
        errG.backward()
        optimizerG.step()
        losses.append([(errD_real + errD_fake).item(), errG.item()])
    modules = {"generator.": generator, "discriminator.": discriminator}
    return result(DDP, modules, values={"local_losses": torch.tensor(losses)})
