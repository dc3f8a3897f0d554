"""megajax: Megatron-LM tensor parallelism in JAX and Flax NNX."""
from megajax.config import Config, ConfigError, ModelConfig, TrainConfig, load_config
from megajax.mesh import make_mesh
from megajax.bert import BERT
from megajax.model import GPT, abstract_model, init_model, param_specs
from megajax.train_step import make_trainer
from megajax.generate import generate
from megajax.audit import audit  # noqa: E402  (the function; the module stays megajax.audit in sys.modules)

__all__ = ["BERT", "Config", "ConfigError", "GPT", "ModelConfig", "TrainConfig", "abstract_model", "audit",
           "generate", "init_model", "load_config", "make_mesh", "make_trainer", "param_specs"]
