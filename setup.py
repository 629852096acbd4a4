"""Packaging for lms-tf (distribution ``lms-tf``, package ``lms_tf``, console script ``lms-tf``)."""

from setuptools import find_packages, setup

# The range between the two pairs the whole suite runs on (constraints/oldest.txt and
# constraints/latest.txt: scripts/test.sh runs it on both). Keras 3.10-3.14 and TensorFlow 2.16
# fail part of it (docs/limits.md): they are not claimed.
TENSORFLOW = "tensorflow>=2.20.0,<=2.21.0"
KERAS = "keras==3.15.1"
TF_KERAS = "tf-keras>=2.20.1,<=2.21.0"
# The documentation site's tools, pinned: `mkdocs build --strict` runs in the test suite, and a
# new release's warnings must not turn CI red on their own.
DOCS = ["mkdocs==1.6.1", "mkdocs-material==9.8.2", "mkdocstrings==1.0.8", "mkdocstrings-python==2.0.11"]

setup(
    name="lms-tf",
    version="0.1.0",
    description="Large Model Support for TensorFlow / Keras 3 (tested on TensorFlow 2.20 and 2.21 with Keras 3.15): "
                "swap and recompute activations so training fits in less GPU memory.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["lms_tf", "lms_tf.*"]),
    install_requires=[TENSORFLOW, KERAS, "numpy"],
    extras_require={
        "gpu": [TENSORFLOW.replace("tensorflow", "tensorflow[and-cuda]", 1)],
        "legacy-keras": [TF_KERAS],
        "plot": ["matplotlib>=3.7"],
        "docs": DOCS,
        "test": [TF_KERAS, "pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.5", "matplotlib>=3.7",
                 "import-linter>=2.1", *DOCS],
    },
    entry_points={"console_scripts": ["lms-tf=lms_tf.cli:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
