"""Ships the repository's top-level model_cards/ inside the wheel as hf_speculators/model_cards/ (see pyproject.toml).

The cards live at the top level so that they read as a folder of Hub model cards; the package finds them there in a
checkout or an editable install, and here in an installed wheel (hf_speculators.config.presets.bundled_presets_dir).
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithModelCards(build_py):
    """`build_py` that also copies model_cards/ into the built package."""

    def run(self):
        super().run()
        self.copy_tree("model_cards", str(Path(self.build_lib) / "hf_speculators" / "model_cards"))


setup(cmdclass={"build_py": BuildPyWithModelCards})
