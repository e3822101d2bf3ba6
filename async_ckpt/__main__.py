import sys

from async_ckpt.cli import main

sys.exit(main())
