"""One stack of the four real services (separate processes) shared by the integration tests."""
import asyncio

import pytest

from services.launch.stack import throwaway_stack


@pytest.fixture(scope="session")
def stack(tmp_path_factory):
    st = throwaway_stack(tmp_path_factory.mktemp("stack"))
    try:
        asyncio.run(st.start(timeout=420))
    except BaseException:
        st.stop()
        raise
    yield st, st.endpoints
    st.stop()
