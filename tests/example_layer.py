"""Loading examples/llama_layer.py in the tests that check it against Hugging Face."""
import importlib.util
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "llama_layer.py"


def load_example():
    """The example as a module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("llama_layer", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def to_numpy(tensor):
    """A torch tensor as a float32 NumPy array of its own."""
    return tensor.detach().float().numpy().copy()
