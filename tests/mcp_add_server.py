"""An MCP server in the mcp SDK's documented FastMCP style, served over stdio."""

from mcp.server.fastmcp import FastMCP

mcp = FastMCP("Adder")


@mcp.tool()
def add(a: int, b: int) -> int:
    """Add two numbers"""
    return a + b


if __name__ == "__main__":
    mcp.run()
