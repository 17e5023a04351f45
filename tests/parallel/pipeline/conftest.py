"""Every pipeline test runs its ranks in strict comm mode (NCCL's ordering and device rules on gloo)."""

from tests.strict_comm import strict_comm_fixture

strict_comm = strict_comm_fixture("package")
