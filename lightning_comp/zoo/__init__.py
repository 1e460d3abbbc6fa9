"""Model zoo of ``lightning_comp``: LightningModules and LightningDataModules with embedded data.

Nothing here downloads anything. Data sets are generated (MNIST-1D, Shapes10) or read from Python's own files
(``pydoc_data.topics`` text). Models share the size knobs ``width``/``depth``; data modules share ``num_samples`` and
``batch_size``. The Hydra config tree in :mod:`lightning_comp.conf` refers to these classes by ``_target_``.

=================  =========================  ===========================  =====================================
Hydra option       class                      data (option, kind)          operators
=================  =========================  ===========================  =====================================
``cnn1d``          :class:`Conv1DClassifier`  ``mnist1d`` (signal)         Conv1d, ReLU, Linear
``gru``            :class:`GRUClassifier`     ``mnist1d`` (signal)         GRU, Linear
``narrow_mlp``     :class:`NarrowMLP`         ``mnist1d`` (signal)         many tiny Linear, ReLU
``char_lstm``      :class:`CharLSTM`          ``text`` (tokens)            Embedding, 2-layer LSTM, Linear
``char_gpt``       :class:`CharGPT`           ``text`` (tokens)            Linear, LayerNorm, GELU, attention
``convnet_bn``     :class:`ConvNetBN`         ``shapes`` (image)           Conv2d, BatchNorm2d, ReLU, MaxPool, Linear
``hf_gpt2``        :class:`HFGPT2`            ``text`` (tokens)            transformers GPT-2 (extra ``hf``)
``litgpt``         :class:`LitGPT`            ``text`` (tokens)            litgpt GPT, LLaMA-style (``litgpt``)
``litgpt_moe``     :class:`LitGPT`            ``text`` (tokens)            litgpt GPT, mixture of experts
``x_transformer``  :class:`XTransformerLM`    ``text`` (tokens)            x-transformers decoder
                                                                           (extra ``xtransformers``)
``tv_resnet``      :class:`TorchvisionResNet` ``shapes`` (image)           torchvision ResNet (extra ``vision``)
=================  =========================  ===========================  =====================================

The last six wrap libraries' own models (:mod:`lightning_comp.zoo.third_party`); their libraries are imported only
when such a model is built.
"""

from lightning_comp.zoo.callbacks import EpochTimer
from lightning_comp.zoo.data import DATA_KINDS, InMemoryDataModule, MNIST1DDataModule, load_mnist1d
from lightning_comp.zoo.images import CLASS_NAMES, ShapesDataModule, make_shapes
from lightning_comp.zoo.language_models import CharGPT, CharLSTM
from lightning_comp.zoo.models import (
    ClassifierModule,
    Conv1DClassifier,
    ConvNetBN,
    GRUClassifier,
    LanguageModelModule,
    NarrowMLP,
    ZooModule,
)
from lightning_comp.zoo.text import VOCAB_SIZE, CharTextDataModule, load_corpus
from lightning_comp.zoo.third_party import HFGPT2, LitGPT, TorchvisionResNet, XTransformerLM

__all__ = [
    "CLASS_NAMES",
    "DATA_KINDS",
    "VOCAB_SIZE",
    "CharGPT",
    "CharLSTM",
    "CharTextDataModule",
    "ClassifierModule",
    "Conv1DClassifier",
    "ConvNetBN",
    "EpochTimer",
    "GRUClassifier",
    "HFGPT2",
    "InMemoryDataModule",
    "LanguageModelModule",
    "LitGPT",
    "MNIST1DDataModule",
    "NarrowMLP",
    "ShapesDataModule",
    "TorchvisionResNet",
    "XTransformerLM",
    "ZooModule",
    "load_corpus",
    "load_mnist1d",
    "make_shapes",
]
