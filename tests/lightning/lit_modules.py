"""LightningModules written the way Lightning's documentation writes them (nothing of the engine
in them; on ``pytorch_lightning``, and on ``lightning.pytorch`` as Lightning's examples are),
Lightning's demo modules, their data, and how the tests train them through
engine.lightning.Trainer."""

from __future__ import annotations

import os
import random

import lightning.pytorch as L
import torch
import pytorch_lightning as pl
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.demos import BoringModel, LightningTransformer
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

FEATURES, TIME, VOCAB = 12, 16, 10


class LinearOnly(pl.LightningModule):
    """The smallest module the adapter runs: one linear layer, training_step and an SGD."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(FEATURES, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class LitAutoEncoder(pl.LightningModule):
    """Lightning's front-page autoencoder, on 12 features."""

    def __init__(self, hidden: int = 16, lr: float = 1e-2):
        super().__init__()
        self.save_hyperparameters()
        self.encoder = nn.Sequential(nn.Linear(FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, 3))
        self.decoder = nn.Sequential(nn.Linear(3, hidden), nn.ReLU(), nn.Linear(hidden, FEATURES))

    def training_step(self, batch, batch_idx):
        x, _ = batch
        x = x.view(x.size(0), -1)
        x_hat = self.decoder(self.encoder(x))
        loss = F.mse_loss(x_hat, x)
        self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, _ = batch
        x = x.view(x.size(0), -1)
        self.log("val_loss", F.mse_loss(self.decoder(self.encoder(x)), x))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


class LitGAN(pl.LightningModule):
    """The manual-optimization GAN of Lightning's docs, on 12-feature "images"."""

    def __init__(self, latent_dim: int = 4, lr: float = 2e-3):
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(latent_dim, 16), nn.ReLU(), nn.Linear(16, FEATURES))
        self.discriminator = nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch):
        imgs, _ = batch
        optimizer_g, optimizer_d = self.optimizers()
        z = torch.randn(imgs.shape[0], self.hparams.latent_dim).type_as(imgs)
        valid = torch.ones(imgs.size(0), 1).type_as(imgs)
        fake = torch.zeros(imgs.size(0), 1).type_as(imgs)

        self.toggle_optimizer(optimizer_g)
        g_loss = F.binary_cross_entropy_with_logits(self.discriminator(self.generator(z)), valid)
        self.log("g_loss", g_loss, prog_bar=True)
        self.manual_backward(g_loss)
        optimizer_g.step()
        optimizer_g.zero_grad()
        self.untoggle_optimizer(optimizer_g)

        self.toggle_optimizer(optimizer_d)
        real_loss = F.binary_cross_entropy_with_logits(self.discriminator(imgs), valid)
        fake_loss = F.binary_cross_entropy_with_logits(self.discriminator(self.generator(z).detach()), fake)
        d_loss = (real_loss + fake_loss) / 2
        self.log("d_loss", d_loss, prog_bar=True)
        self.manual_backward(d_loss)
        optimizer_d.step()
        optimizer_d.zero_grad()
        self.untoggle_optimizer(optimizer_d)

    def configure_optimizers(self):
        lr = self.hparams.lr
        opt_g = torch.optim.Adam(self.generator.parameters(), lr=lr, betas=(0.5, 0.999))
        opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=lr, betas=(0.5, 0.999))
        return [opt_g, opt_d], []


class LitManualClipped(pl.LightningModule):
    """Manual optimization with Lightning's self.clip_gradients, by norm and by value."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.encoder = nn.Linear(FEATURES, 3)
        self.decoder = nn.Linear(3, FEATURES)

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        x, _ = batch
        loss = F.mse_loss(self.decoder(self.encoder(x)), x)
        self.log("train_loss", loss)
        optimizer.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(optimizer, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        self.clip_gradients(optimizer, gradient_clip_val=0.01, gradient_clip_algorithm="value")
        optimizer.step()
        self.lr_schedulers().step()

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=1.0)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)]


class LitTBPTT(pl.LightningModule):
    """A Lightning 1.x truncated-BPTT module: ``truncated_bptt_steps``, ``hiddens``, a dict return."""

    def __init__(self):
        super().__init__()
        self.truncated_bptt_steps = 4
        self.rnn = nn.LSTM(FEATURES, 8, batch_first=True)
        self.head = nn.Linear(8, FEATURES)

    def training_step(self, batch, batch_idx, hiddens):
        x, y = batch
        out, hiddens = self.rnn(x, hiddens)
        loss = F.mse_loss(self.head(out), y)
        self.log("train_loss", loss)
        return {"loss": loss, "hiddens": hiddens}

    def validation_step(self, batch, batch_idx):
        x, y = batch
        out, _ = self.rnn(x)
        self.log("val_loss", F.mse_loss(self.head(out), y))

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class LitGRULM(pl.LightningModule):
    """A GRU language model whose learning rate ReduceLROnPlateau lowers when val_loss stalls."""

    def __init__(self, vocab: int = VOCAB, hidden: int = 16, lr: float = 0.5):
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab, hidden)
        self.gru = nn.GRU(hidden, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens):
        output, _ = self.gru(self.embed(tokens))
        return self.head(output)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x).flatten(0, 1), y.flatten()))

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
        # threshold=0.5: only halving val_loss counts as progress, so the rate drops every epoch
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0, threshold=0.5)
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "monitor": "val_loss", "interval": "epoch", "frequency": 1}}


class LitExampleAutoEncoder(L.LightningModule):
    """An autoencoder in the shape of Lightning's basics examples: a forward for inference, a
    shared step, ``self.log(..., on_step=True)`` in validation_step and test_step, a
    predict_step, the test and validation-batch hooks, and its own callbacks from
    configure_callbacks (EarlyStopping's min_delta ends the run after its second validation)."""

    def __init__(self, hidden: int = 8, lr: float = 1e-2):
        super().__init__()
        self.save_hyperparameters()
        self.encoder = nn.Sequential(nn.Linear(FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, 3))
        self.decoder = nn.Sequential(nn.Linear(3, hidden), nn.ReLU(), nn.Linear(hidden, FEATURES))
        self.seen = []  # what the hooks were given, for the in-process tests

    def forward(self, x):
        return self.decoder(self.encoder(x))

    def _shared_step(self, batch):
        x, _ = batch
        return F.mse_loss(self(x), x)

    def training_step(self, batch, batch_idx):
        loss = self._shared_step(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self._shared_step(batch)
        self.log("val_loss", loss, on_step=True)
        return loss

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self._shared_step(batch), on_step=True)

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        return self(batch[0])

    def on_validation_batch_end(self, outputs, batch, batch_idx):
        self.seen.append(("on_validation_batch_end", float(outputs), batch_idx))

    def on_test_epoch_end(self):
        self.seen.append(("on_test_epoch_end", self.global_step))

    def configure_callbacks(self):
        return [EarlyStopping(monitor="val_loss", patience=1, min_delta=1.0),
                ModelCheckpoint(monitor="val_loss", save_top_k=1)]

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


class Backbone(nn.Module):
    """A small feature extractor handed to the classifier, as the backbone example does."""

    def __init__(self, hidden: int = 16):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(FEATURES, hidden), nn.ReLU())

    def forward(self, x):
        return self.layers(x)


class LitBackboneClassifier(L.LightningModule):
    """A classifier in the shape of Lightning's backbone example: a backbone module, a linear
    head, cross entropy, ``self.log(..., on_step=True)`` in validation_step, test_step and a
    predict_step, and a validation batch hook."""

    def __init__(self, backbone=None, classes: int = 3, lr: float = 0.1):
        super().__init__()
        self.save_hyperparameters(ignore=["backbone"])
        self.backbone = backbone if backbone is not None else Backbone()
        self.head = nn.Linear(16, classes)
        self.seen = []

    def forward(self, x):
        return self.head(self.backbone(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("valid_loss", F.cross_entropy(self(x), y), on_step=True, on_epoch=False)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.cross_entropy(self(x), y))

    def predict_step(self, batch, batch_idx, dataloader_idx=None):
        return self(batch[0]).argmax(dim=1)

    def on_validation_batch_start(self, batch, batch_idx):
        self.seen.append(("on_validation_batch_start", batch_idx, len(batch[0])))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


# Lightning's demo modules, unchanged: BoringModel brings its own data; LightningTransformer reads
# ./data/wikitext-2.txt (written by write_wikitext, so it never downloads).
TRANSFORMER_WORDS = 12


def write_wikitext(directory: str) -> None:
    """A tiny wikitext-2.txt in ``directory``/data: every word of TRANSFORMER_WORDS in the first line."""
    words = [f"w{index}" for index in range(TRANSFORMER_WORDS)]
    generator = random.Random(0)
    lines = [" ".join(words)] + [" ".join(generator.choice(words) for _ in range(20)) for _ in range(6)]
    os.makedirs(os.path.join(directory, "data"), exist_ok=True)
    with open(os.path.join(directory, "data", "wikitext-2.txt"), "w") as file:
        file.write("\n".join(lines) + "\n")


def transformer():
    return LightningTransformer(vocab_size=TRANSFORMER_WORDS + 1)  # and "<eos>"


def labelled(samples: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(samples, FEATURES, generator=generator),
                         torch.randint(0, 3, (samples,), generator=generator))


def tokens(samples: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    text = torch.randint(0, VOCAB, (samples, TIME + 1), generator=generator)
    return TensorDataset(text[:, :-1], text[:, 1:])


def vectors(samples: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(samples, FEATURES, generator=generator), torch.zeros(samples))


def sequences(samples: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, TIME + 1, FEATURES, generator=generator)
    return TensorDataset(x[:, :-1], x[:, 1:])


def loaders(name: str, shuffle: bool = True) -> tuple[DataLoader, DataLoader]:
    """Training (40 samples in batches of 8, shuffled) and validation data (20 samples: the last
    batch is smaller, so epoch means are weighted)."""
    make = {"tbptt": sequences, "gru_lm": tokens, "classifier": labelled}.get(name, vectors)
    return (DataLoader(make(40, 1), batch_size=8, shuffle=shuffle),
            DataLoader(make(20, 2), batch_size=8))


MODULES = {"autoencoder": LitAutoEncoder, "checkpointed": LitAutoEncoder, "gan": LitGAN, "tbptt": LitTBPTT,
           "gru_lm": LitGRULM, "clipped": LitManualClipped, "example_autoencoder": LitExampleAutoEncoder,
           "classifier": LitBackboneClassifier, "boring": BoringModel, "transformer": transformer}
OWN_DATA = ("boring", "transformer")  # Lightning's demos: their train_dataloader() / val_dataloader()


def build(name: str, seed: int = 7) -> pl.LightningModule:
    pl.seed_everything(seed, verbose=False)  # torch, random and NumPy, as Lightning users seed
    return MODULES[name]()
