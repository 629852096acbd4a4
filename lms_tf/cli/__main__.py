"""``python -m lms_tf.cli``: the ``lms-tf`` command line.

Examples:
    >>> from lms_tf.cli import main
"""

import sys

from lms_tf.cli import main

if __name__ == "__main__":
    sys.exit(main())
