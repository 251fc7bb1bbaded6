"""`python -m sparkserve ...` works like the `sparkserve` command."""
import sys

from sparkserve.cli import main

sys.exit(main())
